"""The house keeps its shape (issue 21): layers in order, no import circles inside graphgrow, small modules.

graphgrow's modules live in subpackages that are its layers (LAYERS, lowest first); a module imports only
from its own layer and the layers below it, never from a higher one.

The import graph is read from the source (every `import` and `from … import`, also inside
functions: a lazy import is still a dependency); a circle fails with its modules named.
Modules stay under 500 lines; the ones still over it are listed here by name as known debt,
and the list may only shrink (a listed module that got small must leave the list).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
from conftest import ROOT

# The layers, lowest first: a module may import its own layer and the ones above it in this list, never one below.
# `graphgrow` itself (its __init__: the public API) sits on top of them all.
LAYERS = [
    "core",  # errors, names, state: the words every layer shares
    "graph",  # the traced model as data: metadata, editing nodes, shapes, graphgrow's own layers
    "io",  # models in and out: files, names, safe formats, outputs, lineage, ONNX, onnxruntime
    "analysis",  # what a graph allows: channel coupling, stages and places (Candidate), budgets
    "capture",  # nn.Module → GraphModule, checked against the module (core.protocol's comparison)
    "verify",  # a change proven: preservation, the check after a pass, equivalence
    "rewrite",  # the pass contract, growth over coupling groups, initialisers; the pass author's API
    "jobs",  # registry, pipeline, workflow: what a user runs, as functions
    "search",  # population-based growth on Ray Tune, over the jobs
    "cli",  # the `graphgrow` command
]
MAX_LINES = 500
OVERSIZE: set[str] = set()  # debt: modules still over the limit (none now)


def _modules() -> dict[str, Path]:
    found = {}
    for f in sorted((ROOT / "graphgrow").rglob("*.py")):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = f
    return found


def import_graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, f in mods.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            g.add_edges_from((name, t) for t in targets if t in mods and t != name)
    return g


def test_graphgrow_has_no_import_circles():
    g = import_graph()
    assert g.number_of_edges() > 100  # the reader sees the imports (a broken reader would pass vacuously)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import circles: " + "; ".join(" → ".join(c + [c[0]]) for c in cycles)


def test_the_import_reader_finds_a_circle(tmp_path, monkeypatch):
    """The check can fail: two modules importing each other, one of them lazily."""
    pkg = tmp_path / "graphgrow"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def x():\n    from . import a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert list(nx.simple_cycles(import_graph()))


def layer_of(module: str) -> int:
    """The layer's index (len(LAYERS) for graphgrow's own __init__, the public API on top)."""
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS)
    assert parts[1] in LAYERS, (
        f"{module} is in no layer: move it into one of graphgrow/{{{','.join(LAYERS)}}}/ (or add a layer to LAYERS)"
    )
    return LAYERS.index(parts[1])


def upward_imports(g: nx.DiGraph) -> list[str]:
    return [
        f"{a} ({LAYERS[layer_of(a)]}) imports {b} ({LAYERS[layer_of(b)]})"
        for a, b in g.edges
        if layer_of(a) < layer_of(b)
    ]


def test_lower_layers_never_import_higher_ones():
    g = import_graph()
    assert {m.split(".")[1] for m in g.nodes if "." in m} == set(LAYERS)  # every layer exists, nothing outside them
    bad = upward_imports(g)
    assert not bad, "imports against the layer order (lowest first: " + " < ".join(LAYERS) + "):\n" + "\n".join(bad)


def test_the_layer_check_finds_an_upward_import(tmp_path, monkeypatch):
    """The check can fail: core importing io, lazily inside a function."""
    for pkg in ("core", "io"):
        (tmp_path / "graphgrow" / pkg).mkdir(parents=True)
        (tmp_path / "graphgrow" / pkg / "__init__.py").write_text("")
    (tmp_path / "graphgrow" / "__init__.py").write_text("from .io import b\n")
    (tmp_path / "graphgrow" / "core" / "a.py").write_text("def f():\n    from ..io.b import x\n")
    (tmp_path / "graphgrow" / "io" / "b.py").write_text("from ..core import a\nx = 1\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert upward_imports(import_graph()) == ["graphgrow.core.a (core) imports graphgrow.io.b (io)"]


def test_capture_never_imports_verify():
    """One check protocol (core.protocol) serves capture's fidelity and verification: capture takes nothing from
    verify, directly or through another module it imports."""
    g = import_graph()
    capture = [m for m in g.nodes if m.startswith("graphgrow.capture.")]
    assert len(capture) > 5  # the reader sees capture's modules (a broken reader would pass vacuously)
    reached = {b for m in capture for b in nx.descendants(g, m)}
    bad = sorted(b for b in reached if b.startswith("graphgrow.verify"))
    assert not bad, f"capture reaches verify through its imports: {bad}"
    assert LAYERS.index("capture") < LAYERS.index("verify")


def test_the_capture_rule_sees_an_import_of_verify(tmp_path, monkeypatch):
    """The check can fail: a capture module importing verify lazily, through a helper of its own."""
    for pkg in ("capture", "verify"):
        (tmp_path / "graphgrow" / pkg).mkdir(parents=True)
        (tmp_path / "graphgrow" / pkg / "__init__.py").write_text("")
    (tmp_path / "graphgrow" / "__init__.py").write_text("")
    for i in range(5):
        (tmp_path / "graphgrow" / "capture" / f"m{i}.py").write_text("")
    (tmp_path / "graphgrow" / "capture" / "a.py").write_text("from . import b\n")
    (tmp_path / "graphgrow" / "capture" / "b.py").write_text("def f():\n    from ..verify.c import x\n")
    (tmp_path / "graphgrow" / "verify" / "c.py").write_text("x = 1\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    import pytest

    with pytest.raises(AssertionError, match=r"graphgrow\.verify\.c"):
        test_capture_never_imports_verify()


def test_each_layer_says_its_job_and_what_it_may_import():
    """The folder tree is the architecture: each layer's __init__ docstring opens with its name and its job, and its
    "May import:" sentence names exactly the layers below it (the docs follow this table)."""
    import re

    for i, name in enumerate(LAYERS):
        doc = ast.get_docstring(ast.parse((ROOT / "graphgrow" / name / "__init__.py").read_text())) or ""
        assert doc.startswith(f"{name}: "), f"graphgrow/{name}/__init__.py does not open with '{name}: its job'"
        said = re.search(r"May import:([^.;]*)", doc)
        assert said, f"graphgrow/{name}/__init__.py does not say what it may import ('May import: …')"
        named = [w for w in re.findall(r"\w+", said.group(1)) if w in LAYERS]
        assert named == LAYERS[:i], (
            f"graphgrow/{name}/__init__.py says it may import {named}; the table says {LAYERS[:i]}"
        )


def test_modules_stay_small():
    sizes = {
        str(f.relative_to(ROOT)): len(f.read_text().splitlines())
        for f in [*(ROOT / "graphgrow").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]
    }
    too_big = {f: n for f, n in sizes.items() if n > MAX_LINES and f not in OVERSIZE}
    assert not too_big, f"modules over {MAX_LINES} lines (split them): {too_big}"
    shrunk = {f for f in OVERSIZE if sizes.get(f, 0) <= MAX_LINES}
    assert not shrunk, f"{shrunk} are within {MAX_LINES} lines now: take them off OVERSIZE"


# --- the op vocabulary (issue 41, item 6) ------------------------------------------------------------------------
VOCABULARY = "graphgrow/graph/ops.py"
MIN_SHARED = 3  # two names in common can be chance ("add", "mul"); three are a copy of a vocabulary class
# tables that list op names on purpose, with why
OWN_TABLES = {
    "graphgrow/io/graph_policy.py": "what a loaded file may call is a safety allowlist: it must not widen when an "
    "analysis learns an op",
}


def _table_names(value: ast.AST) -> list[set[str]]:
    """The op names of each set, list or tuple literal inside a module-level value: strings as they are, functions as
    written (operator.add, F.softmax)."""
    found = []
    for node in ast.walk(value):
        if isinstance(node, (ast.Set, ast.List, ast.Tuple)):
            names = {
                e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else ast.unparse(e)
                for e in node.elts
                if isinstance(e, (ast.Constant, ast.Attribute))
            }
            found.append(names)
    return found


def op_tables(root: Path) -> list[str]:
    """Module-level tables outside the vocabulary module that repeat MIN_SHARED or more of its op names."""
    vocabulary = {
        name
        for node in ast.parse((root / VOCABULARY).read_text()).body
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
        for names in _table_names(node.value)
        for name in names
    }
    assert len(vocabulary) > 40  # the reader sees the vocabulary (an empty one would pass vacuously)
    bad = []
    for f in sorted((root / "graphgrow").rglob("*.py")):
        rel = str(f.relative_to(root))
        if rel == VOCABULARY or rel in OWN_TABLES:
            continue
        for node in ast.parse(f.read_text(), rel).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                for names in _table_names(node.value):
                    shared = names & vocabulary
                    if len(shared) >= MIN_SHARED:
                        bad.append(f"{rel}:{node.lineno} repeats {sorted(shared)}")
    return bad


def test_the_op_vocabulary_lives_in_one_module():
    """Which ops only read a shape, only change a view, act elementwise or reduce is said once, in graph/ops.py:
    an analysis derives its own narrower set from those classes (ops.RESHAPES | {"expand"}), never lists them again."""
    bad = op_tables(ROOT)
    assert not bad, f"op tables outside {VOCABULARY} (import the classes from it):\n" + "\n".join(bad)


def test_the_op_vocabulary_rule_finds_a_copied_table(tmp_path):
    """The check can fail: a module with its own table of shape queries, and one of arithmetic functions."""
    (tmp_path / "graphgrow" / "graph").mkdir(parents=True)
    (tmp_path / VOCABULARY).write_text((ROOT / VOCABULARY).read_text())
    (tmp_path / "graphgrow" / "graph" / "mine.py").write_text(
        'import operator, torch\nfrom . import ops\nQUERIES = {"size", "dim", "numel"}\n'
        'OK = ops.RESHAPES | {"expand"}\n'
        "ADDS: set = frozenset((operator.add, operator.sub, torch.add))\n"
    )
    assert op_tables(tmp_path) == [
        "graphgrow/graph/mine.py:3 repeats ['dim', 'numel', 'size']",
        "graphgrow/graph/mine.py:5 repeats ['operator.add', 'operator.sub', 'torch.add']",
    ]


def doubled_declarations(root: Path) -> list[str]:
    """Pass functions (decorated @pass_function) that write a default of their own, and Pass classes whose
    `function` is not such a function: a second place for an argument's default, which can drift from arg()."""
    bad = []
    for f in sorted((root / "passes").rglob("*.py")):
        rel = str(f.relative_to(root))
        tree = ast.parse(f.read_text(), rel)
        declared = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                (d.id if isinstance(d, ast.Name) else getattr(d, "attr", "")) == "pass_function"
                for d in node.decorator_list
            ):
                declared.add(node.name)
                a = node.args
                named = [p.arg for p in a.args[len(a.args) - len(a.defaults) :]] + [
                    p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None
                ]
                named = [n for n in named if n != "generator"]  # the contract's generator, not a pass argument
                if named:
                    bad.append(f"{rel}:{node.lineno} {node.name}() gives {named} defaults")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if (
                        isinstance(stmt, ast.Assign)
                        and any(getattr(t, "id", "") == "function" for t in stmt.targets)
                        and isinstance(stmt.value, ast.Name)
                        and stmt.value.id not in declared
                    ):
                        bad.append(f"{rel}:{stmt.lineno} {node.name}.function = {stmt.value.id}, not a @pass_function")
    return bad


def test_every_pass_argument_is_declared_once():
    """A built-in pass declares each argument in its Pass class (arg()); its plain function is @pass_function and
    writes no defaults (tests/test_pass_args.py checks the same on the imported classes, plugins included)."""
    bad = doubled_declarations(ROOT)
    assert not bad, "\n".join(bad)


def test_the_declaration_rule_finds_a_second_default(tmp_path):
    (tmp_path / "passes").mkdir()
    (tmp_path / "passes" / "mine.py").write_text(
        "@pass_function\ndef grow(gm, factor=2.0, *, init=None, generator=None):\n    pass\n\n"
        "def plain(gm, target):\n    pass\n\nclass Grow(Pass):\n    function = plain\n"
    )
    assert doubled_declarations(tmp_path) == [
        "passes/mine.py:2 grow() gives ['factor', 'init'] defaults",
        "passes/mine.py:9 Grow.function = plain, not a @pass_function",
    ]
