"""A graphgrow file's graph is code: only a closed list of operations may come from a file (issue: close the holes).

The concrete exploits found by hand are regression tests through the real CLI; a
hypothesis campaign builds graphs from random targets drawn from dir(operator),
dir(builtins), dir(torch) and dir(torch.Tensor) and checks that nothing outside the list
is ever called (an audit-hook canary records processes, file writes and imports while
the graph is loaded and run). GRAPHGROW_FUZZ_EXAMPLES sets the count (`make fuzz`).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import math
import operator
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli, small_cnn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import graphgrow as gg
from graphgrow.core import names as graph_names
from graphgrow.io import graph_policy, serialize
from graphgrow.io.load import load_model

EXAMPLES = int(os.environ.get("GRAPHGROW_FUZZ_EXAMPLES", "60"))


def payload(nodes: list[dict], root: nn.Module | None = None) -> dict:
    """A graphgrow file's content with a hand-written graph (what an attacker controls)."""
    return {
        "format": serialize.FORMAT,
        "version": serialize.VERSION,
        "class_name": "GraphModule",
        "root": root if root is not None else nn.Sequential(nn.Conv2d(3, 4, 3)),
        "nodes": nodes,
        "meta": {"input_shape": [1, 3, 8, 8], "log": []},
    }


def node(name, op, target, *args, **kwargs) -> dict:
    return {
        "name": name,
        "op": op,
        "target": target,
        "args": {"tuple": list(args)},
        "kwargs": {"dict": [[k, v] for k, v in kwargs.items()]},
        "scope": [],
    }


X = {"node": "x"}


def attrgetter_chain(marker: Path) -> list[dict]:
    """__class__.__repr__.__globals__ → ['torch'] → os.system → call: runs a command when the graph runs."""
    return [
        node("x", "placeholder", "x"),
        node("g", "call_function", "operator.attrgetter", "__class__.__repr__.__globals__"),
        node("glob", "call_function", "operator.call", {"node": "g"}, X),
        node("t", "call_function", "operator.getitem", {"node": "glob"}, "torch"),
        node("s", "call_function", "operator.attrgetter", "os.system"),
        node("sys", "call_function", "operator.call", {"node": "s"}, {"node": "t"}),
        node("run", "call_function", "operator.call", {"node": "sys"}, f"touch {marker}"),
        node("output", "output", "output", X),
    ]


EXPLOITS = {
    "attrgetter_chain": attrgetter_chain,
    "methodcaller": lambda m: [
        node("x", "placeholder", "x"),
        node("m", "call_function", "operator.methodcaller", "__reduce__"),
        node("output", "output", "output", X),
    ],
    "getattr_dunder": lambda m: [
        node("x", "placeholder", "x"),
        node("c", "call_function", "builtins.getattr", X, "__class__"),
        node("output", "output", "output", X),
    ],
    "method_dunder": lambda m: [
        node("x", "placeholder", "x"),
        node("c", "call_method", "__reduce_ex__", X, 2),
        node("output", "output", "output", X),
    ],
    "method_apply": lambda m: [
        node("x", "placeholder", "x"),
        node("c", "call_method", "apply_", X, "print"),
        node("output", "output", "output", X),
    ],
    "from_file": lambda m: [
        node("x", "placeholder", "x"),
        node("f", "call_function", "torch.from_file", str(m), True, 1024),
        node("output", "output", "output", X),
    ],
    "os_system": lambda m: [
        node("x", "placeholder", "x"),
        node("s", "call_function", "os.system", f"touch {m}"),
        node("output", "output", "output", X),
    ],
    "get_attr_dict": lambda m: [
        node("x", "placeholder", "x"),
        node("d", "get_attr", "__dict__"),
        node("output", "output", "output", X),
    ],
    "get_attr_hidden": lambda m: [
        node("x", "placeholder", "x"),
        node("d", "get_attr", "0._forward_hooks"),
        node("output", "output", "output", X),
    ],
    "bad_op": lambda m: [
        node("x", "placeholder", "x"),
        node("d", "call_exec", "x"),
        node("output", "output", "output", X),
    ],
}


@pytest.mark.parametrize("kind", list(EXPLOITS))
def test_crafted_graph_files_run_nothing_through_the_cli(kind, tmp_path):
    marker = tmp_path / "pwned"
    f = tmp_path / "evil.grown.pt"
    torch.save(payload(EXPLOITS[kind](marker)), f)
    before = sorted(os.listdir(tmp_path))
    proc = run_cli("inspect", str(f), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "nothing was run" in lines[0] or "not in the saved model" in lines[0]
    assert "--trust" in lines[0] or "corrupted" in lines[0] or "hostile" in lines[0]
    assert not marker.exists()
    assert sorted(os.listdir(tmp_path)) == before


def test_get_attr_of_a_non_tensor_attribute_is_refused(tmp_path):
    root = nn.Sequential(nn.Conv2d(3, 4, 3))
    nodes = [
        node("x", "placeholder", "x"),
        node("p", "get_attr", "0.padding_mode"),
        node("output", "output", "output", X),
    ]
    with pytest.raises(gg.LoadError, match="reads the attribute '0.padding_mode'"):
        serialize.from_payload(payload(nodes, root))


def test_trust_is_the_only_way_past():
    nodes = [
        node("x", "placeholder", "x"),
        node("n", "call_function", "torch.manual_seed", 0),
        node("output", "output", "output", X),
    ]
    with pytest.raises(gg.LoadError, match="calls 'torch.manual_seed'"):  # global state: no ATen operator, not listed
        serialize.from_payload(payload(nodes))
    gm = serialize.from_payload(payload(nodes), trusted=True)
    assert any(n.target is torch.manual_seed for n in gm.graph.nodes)


def test_mode_flags_and_faithful_graphs_survive_save_and_load(tmp_path):
    from test_trace_fidelity import sd_net

    gm = gg.trace(sd_net(), (1, 3, 8, 8))
    gm.eval()
    gm.get_submodule("blocks.0.bn").train()  # a deliberate mix: kept as saved
    gg.save_model(gm, tmp_path / "m.pt")
    back = load_model(tmp_path / "m.pt").module
    assert [m.training for m in back.modules()] == [m.training for m in gm.modules()]
    assert any(n.op == "get_attr" and n.target.endswith(".training") for n in back.graph.nodes)


@pytest.mark.parametrize("shape", [[1, 3, 100000, 100000], [-1, 3, 32, 32], "abc", [1.5, 3], []])
def test_a_stored_input_shape_is_validated(shape, tmp_path):
    p = payload(
        [
            node("x", "placeholder", "x"),
            node("c", "call_module", "0", X),
            node("output", "output", "output", {"node": "c"}),
        ]
    )
    p["meta"]["input_shape"] = shape
    f = tmp_path / "m.pt"
    torch.save(p, f)
    proc = run_cli("inspect", str(f), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("log", [[{"pass": "deepen"}] * 20_000, "deep"])
def test_a_huge_or_deep_mutation_log_is_refused_quickly(log, tmp_path):
    if log == "deep":
        deep: list = []
        for _ in range(200):
            deep = [deep]
        log = [{"pass": "deepen", "args": deep}]
    p = payload([node("x", "placeholder", "x"), node("output", "output", "output", X)])
    p["meta"]["log"] = log
    with pytest.raises(gg.LoadError):
        serialize.from_payload(p)


# ---- the random campaign -------------------------------------------------------------


def _candidates() -> list[tuple[str, str]]:
    out = []
    for mod, prefix in ((operator, "operator"), (builtins, "builtins"), (torch, "torch")):
        out += [("call_function", f"{prefix}.{n}") for n in dir(mod) if callable(getattr(mod, n, None))]
    out += [("call_method", n) for n in dir(torch.Tensor)]
    return sorted(set(out))


CANDIDATES = _candidates()
ARGS = st.lists(
    st.one_of(
        st.just(X),
        st.integers(-3, 3),
        st.sampled_from(["", "x", "os", "__class__", "/tmp/gg-canary"]),
        st.booleans(),
        st.none(),
    ),
    max_size=3,
)
FORBIDDEN_EVENTS = (
    "os.system",
    "subprocess.Popen",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.remove",
    "os.rename",
    "os.rmdir",
    "shutil.",
    "ctypes.",
    "socket.",
    "os.kill",
)
_SEEN: list[str] = []
_ARMED = [False]


def _audit(event: str, args) -> None:
    if _ARMED[0] and (
        event.startswith(FORBIDDEN_EVENTS)
        or (event == "open" and len(args) > 1 and isinstance(args[1], str) and any(c in args[1] for c in "wax+"))
    ):
        _SEEN.append(event)


sys.addaudithook(_audit)  # hooks cannot be removed; it records only while armed


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 100,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(st.tuples(st.sampled_from(CANDIDATES), ARGS), min_size=1, max_size=3))
def test_random_graphs_never_call_anything_outside_the_list(tmp_path, ops):
    nodes = [node("x", "placeholder", "x")]
    for i, ((op, target), args) in enumerate(ops):
        nodes.append(node(f"n{i}", op, target, *args))
    nodes.append(node("output", "output", "output", X))
    f = tmp_path / "fuzz.pt"
    torch.save(payload(nodes, small_cnn()), f)
    _SEEN.clear()
    _ARMED[0] = True
    try:
        loaded = load_model(f)
        for n in loaded.module.graph.nodes:  # what got through is on the list, always
            if n.op == "call_function":
                assert graph_policy.allowed_function(serialize.qualified_name(n.target))
            elif n.op == "call_method":
                assert graph_policy.allowed_method(n.target)
        with contextlib.suppress(gg.GraphgrowError):
            gg.annotate(loaded.module, (1, 3, 8, 8))
    except gg.LoadError:
        pass
    finally:
        _ARMED[0] = False
    assert not _SEEN, _SEEN


def test_builtins_keep_their_module_when_saved_and_loaded_again(tmp_path):
    """Found by the fuzzer: torch.fx names `len` bare, which the loader's allow-list (builtins.len) refused on
    reload."""
    assert serialize.qualified_name(len) == "builtins.len" and serialize.qualified_name(getattr) == "builtins.getattr"
    assert serialize.qualified_name(int) == "builtins.int"


# ---- names are data: a campaign of injection strings over every named field (issue 20) -------------

CANARY = "/tmp/gg-name-canary"
_CORES = (
    f'__import__("os").system("touch {CANARY}")',
    f"getattr(__import__('os'),'system')('touch\\x20{CANARY}')",
    f"exec('import os;os.system(\"touch {CANARY}\")')",
    "eval(compile('import os','x','exec'))",
)
_PREFIXES = ("", "x", '"', "'", ")", '6")', "x=", "x:", "\n", "ｓｅｌｆ", "\\x22", "*", "0.", "a b", "lambda:")
_SUFFIXES = ("", "(", "#", '"', ",b", "\n", ')if(1)else(getattr)(self,"6', "\\", ";x=1", ".", "\u2028")
INJECTION = st.builds(
    lambda p, c, s, pad: p + c + s + "a" * pad,
    st.sampled_from(_PREFIXES),
    st.sampled_from(_CORES),
    st.sampled_from(_SUFFIXES),
    st.sampled_from([0, 0, 0, 10, 5000]),
)
LOOKALIKES = st.sampled_from(["ｓｅｌｆ", "ѕelf", "ｔｏｒｃｈ", "ℌx", "x\u200by", "ﬁle", "ﬀ", "𝐱"])
PLAIN = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
NAMES = st.one_of(INJECTION, LOOKALIKES, PLAIN, st.text(max_size=30))

FIELDS = (
    "node_name",
    "placeholder",
    "output_target",
    "module_key",
    "nested_module_key",
    "parameter_name",
    "buffer_name",
    "method",
    "kwarg_key",
    "scope",
    "class_name",
    "getattr_name",
    "get_attr_target",
    "call_module_target",
    "string_constant",
    "dict_constant_key",
)


def _base_payload() -> dict:
    gm = gg.trace(small_cnn(), (1, 3, 8, 8), check=False)
    return serialize.to_payload(gm)


def _rename_refs(value, old: str, new: str):
    if isinstance(value, list):
        return [_rename_refs(v, old, new) for v in value]
    if isinstance(value, dict):
        if value == {"node": old}:
            return {"node": new}
        return {k: _rename_refs(v, old, new) for k, v in value.items()}
    return value


def _rename_module(parent: nn.Module, old: str, new: str) -> None:
    parent._modules = type(parent._modules)((new if k == old else k, v) for k, v in parent._modules.items())


def inject(p: dict, field: str, s: str) -> None:
    """Put the drawn string `s` into one named field of a valid payload, keeping the rest consistent."""
    nodes, root = p["nodes"], p["root"]
    x = next(r for r in nodes if r["op"] == "placeholder")
    out = nodes[-1]
    if field == "node_name":
        old = nodes[1]["name"]
        for r in nodes:
            r["name"] = s if r["name"] == old else r["name"]
            r["args"], r["kwargs"] = _rename_refs(r["args"], old, s), _rename_refs(r["kwargs"], old, s)
    elif field == "placeholder":
        x["target"] = s
    elif field == "output_target":
        out["target"] = s
    elif field in ("module_key", "nested_module_key", "call_module_target"):
        rec = next(r for r in nodes if r["op"] == "call_module")
        if field == "call_module_target":
            rec["target"] = s
        elif field == "module_key":
            _rename_module(root, rec["target"], s)
            rec["target"] = s
        else:  # a child two levels down, reached through a path with the drawn segment in the middle
            holder = nn.Module()
            holder.add_module("inner", root._modules[rec["target"]])
            _rename_module(root, rec["target"], "wrap")
            root._modules["wrap"] = nn.Module()
            root._modules["wrap"]._modules[s] = holder
            rec["target"] = f"wrap.{s}.inner"
    elif field in ("parameter_name", "buffer_name", "get_attr_target"):
        conv = root._modules[next(r for r in nodes if r["op"] == "call_module")["target"]]
        table = conv._parameters if field == "parameter_name" else conv._buffers
        if field != "get_attr_target":
            table[s] = torch.zeros(1)
        first = next(r for r in nodes if r["op"] == "call_module")["target"]
        nodes.insert(
            1,
            {
                "name": "probe",
                "op": "get_attr",
                "target": s if field == "get_attr_target" else f"{first}.{s}",
                "args": {"tuple": []},
                "kwargs": {"dict": []},
                "scope": [],
            },
        )
    elif field == "method":
        nodes.insert(
            1,
            {
                "name": "probe",
                "op": "call_method",
                "target": s,
                "args": {"tuple": [{"node": x["name"]}]},
                "kwargs": {"dict": []},
                "scope": [],
            },
        )
    elif field == "kwarg_key":
        nodes.insert(
            1,
            {
                "name": "probe",
                "op": "call_function",
                "target": "torch.relu",
                "args": {"tuple": [{"node": x["name"]}]},
                "kwargs": {"dict": [[s, 1]]},
                "scope": [],
            },
        )
    elif field == "scope":
        nodes[1]["scope"] = [s]
    elif field == "class_name":
        p["class_name"] = s
    elif field == "getattr_name":
        nodes.insert(
            1,
            {
                "name": "probe",
                "op": "call_function",
                "target": "builtins.getattr",
                "args": {"tuple": [{"node": x["name"]}, s]},
                "kwargs": {"dict": []},
                "scope": [],
            },
        )
    elif field in ("string_constant", "dict_constant_key"):
        value = s if field == "string_constant" else {"dict": [[s, 1]]}
        nodes.insert(
            1,
            {
                "name": "probe",
                "op": "call_function",
                "target": "torch.flatten",
                "args": {"tuple": [{"node": x["name"]}]},
                "kwargs": {"dict": [["extra", value]]},
                "scope": [],
            },
        )


@functools.cache
def _base_strings() -> frozenset[str]:
    """Every name and string constant in the generated code of the payload the drawn strings are injected into."""
    import ast as pyast

    gm = serialize.from_payload(_base_payload())
    found = set()
    for sub in pyast.walk(pyast.parse(gm.code)):
        for text in (
            getattr(sub, "id", None),
            getattr(sub, "attr", None),
            getattr(sub, "arg", None),
            getattr(sub, "value", None),
        ):
            if isinstance(text, str):
                found.add(text)
    return frozenset(found)


def _assert_code_is_clean(code: str, s: str, field: str) -> None:
    """The answer when a file loads: its generated code shows no drawn string except as a quoted constant (a
    name that is not a plain identifier is kept as data and reached through a generated identifier)."""
    import ast as pyast

    tree = pyast.parse(code)
    # a string the untouched model's own code holds (nn.Sequential's module "0" read as getattr(self, "0")) says
    # nothing about where the drawn one went
    if (
        field not in ("string_constant", "dict_constant_key")
        and not graph_names.is_identifier(s)
        and s not in _base_strings()
    ):
        for sub in pyast.walk(tree):  # neither as a name, an attribute, a parameter, a keyword nor a quoted string
            assert s not in (
                getattr(sub, "id", None),
                getattr(sub, "attr", None),
                getattr(sub, "arg", None),
                getattr(sub, "value", None),
            ), (field, s)
        if len(s) >= 4 and s.strip():
            assert s not in code, (field, s)  # nor pasted anywhere (a short string such as '"' occurs in any code)
    for sub in pyast.walk(tree):
        for text in (getattr(sub, "id", None), getattr(sub, "attr", None), getattr(sub, "arg", None)):
            assert not (isinstance(text, str) and ("system" in text or "import" in text or "exec" in text)), (
                field,
                text,
            )


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 100,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(field=st.sampled_from(FIELDS), s=NAMES, trusted=st.booleans())
def test_drawn_names_never_reach_generated_code(tmp_path, field, s, trusted):
    p = _base_payload()
    inject(p, field, s)
    f = tmp_path / "names.pt"
    torch.save(p, f)
    _SEEN.clear()
    _ARMED[0] = True
    try:
        gm = load_model(f, trust=trusted).module
        gm.eval()
        with contextlib.suppress(Exception):  # a loaded graph may still be wrong for this input; what it ran matters
            gm(torch.randn(1, 3, 8, 8))
        _assert_code_is_clean(gm.code, s, field)
    except gg.LoadError as e:
        assert "\n" not in str(e) and len(str(e)) < 1500, str(e)
    finally:
        _ARMED[0] = False
    assert not _SEEN, _SEEN
    assert not Path(CANARY).exists()


def test_the_second_wall_catches_what_the_first_would_miss(monkeypatch):
    """With the name checks and the generated identifiers (core/codegen.py) switched off — fx pasting every name
    as it writes it — the parsed-code check alone refuses each injection of the issue."""
    import torch.fx.graph as fx_graph

    from graphgrow.core import codegen

    monkeypatch.setattr(codegen, "adopt", lambda graph: graph)
    monkeypatch.setattr(fx_graph, "_format_target", codegen._fx_format_target)  # fx's own: pasted between quotes
    monkeypatch.setattr(graph_names, "bad_name_in_record", lambda rec: None)
    monkeypatch.setattr(graph_names, "bad_name_in_tree", lambda root: None)
    monkeypatch.setattr(graph_names, "bad_keywords", lambda kwargs: None)
    for field, s in (
        ("placeholder", f"input=__import__('os').system('touch {CANARY}')"),
        ("module_key", f'6")if(getattr(__import__("os"),"system")("touch\\x20{CANARY}"))else(getattr)(self,"6'),
        ("kwarg_key", f"a=__import__('os').system('touch {CANARY}'),b"),
        ("method", "__class__"),
    ):  # node names fx itself rewrites (`ｔｏｒｃｈ` → `_`)
        p = _base_payload()
        inject(p, field, s)
        with pytest.raises(gg.LoadError, match="unexpected code|not a plain name|inconsistent|safe operations"):
            serialize.from_payload(p, trusted=True)
    assert not Path(CANARY).exists()


def test_graphgrow_never_writes_a_file_it_would_refuse(tmp_path):
    """Names are data (`conv-1` is saved, tests/test_hostile_names.py), but not unbounded: one PyTorch accepts
    and a file may not hold is refused when saving, not written to be refused when read."""
    model = nn.Sequential()
    model.add_module("c" * (graph_names.MAX_NAME + 1), nn.Conv2d(3, 4, 3))
    gm = gg.trace(model, (1, 3, 8, 8))
    with pytest.raises(gg.SaveError, match=f"longer than {graph_names.MAX_NAME} characters"):
        gg.save_model(gm, tmp_path / "m.pt")
    assert not list(tmp_path.iterdir())


class _Gate(nn.Module):
    """timm's CSATv2-style update written with torch functions no list named one by one."""

    def forward(self, x):
        return torch.addcmul(x, torch.sigmoid(x), torch.tanh(x), value=0.5) + torch.lerp(x, x * 2, 0.25)


def test_torch_functions_that_bind_pure_aten_ops_save_and_load(tmp_path):
    gm = gg.trace(_Gate(), input_shape=(1, 4))
    f = tmp_path / "gate.pt"
    gg.save_model(gm, f)
    back = load_model(f).module
    x = torch.randn(2, 4)
    assert torch.equal(back(x), gm(x))
    assert not graph_policy._derived("torch.from_file")  # I/O: excluded in ATen's own classes
    assert not graph_policy._derived("torch.load") and not graph_policy._derived("torch.empty")  # no ATen op; a factory


def test_a_derived_function_called_with_out_is_refused(tmp_path):
    nodes = [
        node("x", "placeholder", "x"),
        node("y", "placeholder", "y"),
        node("a", "call_function", "torch.addcmul", X, X, X, out={"node": "y"}),
        node("output", "output", "output", {"node": "a"}),
    ]
    f = tmp_path / "out.grown.pt"
    torch.save(payload(nodes), f)
    with pytest.raises(gg.LoadError, match="with out="):
        load_model(f)


class _Window(nn.Module):
    """A sliding window cut to the sequence with torch's symbolic-size arithmetic, as torch.export writes it."""

    def forward(self, x):
        n = torch.sym_min(x.shape[-1], 3)
        return x[..., :n] * torch.sym_float(torch.sym_max(n, 1)) + torch.sym_int(torch.sym_not(x.shape[0] > 5))


def test_symbolic_size_arithmetic_saves_and_loads(tmp_path):
    gm = gg.trace(_Window(), input_shape=(1, 6))
    assert {"sym_min", "sym_max", "sym_float", "sym_int", "sym_not"} <= {
        getattr(n.target, "__name__", "") for n in gm.graph.nodes if n.op == "call_function"
    }
    gg.save_model(gm, tmp_path / "w.pt")
    back = load_model(tmp_path / "w.pt").module
    x = torch.randn(2, 6)
    assert torch.equal(back(x), gm(x)) and back(x).shape == (2, 3)


class _Tokens(nn.Module):
    """Spatial dims flattened to tokens with the product written by Python (timm's Hiera: math.prod(shape))."""

    def forward(self, x):
        return x.reshape(x.shape[0], math.prod(x.shape[2:]), x.shape[1])


def test_a_product_of_sizes_saves_and_loads(tmp_path):
    gm = gg.trace(_Tokens(), input_shape=(1, 3, 4, 4), capture="fx")
    assert any(n.target is math.prod for n in gm.graph.nodes)
    gg.save_model(gm, tmp_path / "t.pt")
    back = load_model(tmp_path / "t.pt").module
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(back(x), gm(x)) and back(x).shape == (2, 16, 3)


class _Pooled(nn.Module):
    """Named-tuple fields read by name, in three spellings (HF Hiera: `x.max(dim=...).values`)."""

    def forward(self, x):
        top = torch.topk(x, 2, dim=-1)
        return x.max(dim=-1, keepdim=True).values + torch.sort(x, dim=-1).values[..., :1] * top.indices.float().sum(
            -1, keepdim=True
        )


def test_fields_of_a_reduction_s_named_tuple_save_and_load(tmp_path):
    gm = gg.trace(_Pooled(), input_shape=(2, 3, 4), capture="fx")
    assert {"values", "indices"} <= {n.args[1] for n in gm.graph.nodes if n.target is getattr}
    gg.save_model(gm, tmp_path / "p.pt")
    back = load_model(tmp_path / "p.pt").module
    x = torch.randn(2, 3, 4)
    assert torch.equal(back(x), gm(x))
