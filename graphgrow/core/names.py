"""Names read from a file are data, never code (architecture.md §10: no stored string reaches generated code).

torch.fx turns a graph into Python source and runs it: placeholder targets become the
forward's parameters, node names become variables, module and attribute paths become
`self.a.b` — or `getattr(self, "NAME")`, pasted unescaped, for segments that are not
identifiers — and keyword-argument names are written as `key = value`. Two kinds of name,
two rules:

- names of the model's parts — module, parameter and buffer names, whatever PyTorch
  accepts (`block4-0`, `class`, `名前`, `0`): kept as strings, and written into code only
  through generated identifiers (codegen.py). The only ones refused are those PyTorch
  itself refuses when a module is built — empty, holding a `.`, or the name of an
  attribute the module already has (`forward`, `__class__`: reached through getattr they
  would not be the child) — and those over `MAX_NAME` characters. Node names are data too:
  one that is not a plain identifier is replaced by a generated one on load;
- names that are Python syntax in the forward — input (parameter) names, keyword-argument
  names, method names, attributes read with getattr — are identifiers there: ASCII letters,
  digits and `_`, not starting with a digit, not a Python keyword, no leading `__` (ASCII
  only: Python folds look-alike letters with NFKC, so `ｓｅｌｆ` would *be* `self`).

`check_source` is the second wall: the forward fx generated from a stored graph is parsed
and must consist only of the statement and expression forms fx itself writes, naming only
the graph's own values, `self`, and the globals fx registered — checked before it is
compiled.
"""

from __future__ import annotations

import ast
import keyword
import re
from typing import Any

from torch import fx, nn

MAX_NAME = 200
RULE = "ASCII letters, digits and '_', not a keyword, no leading '__'"
MAX_SEGMENTS = 64
MAX_MODULES = 1_000_000  # a bound on the walk over a module tree read from a file

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def is_identifier(name: Any) -> bool:
    """A name that is safe wherever fx writes it as a Python identifier."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= MAX_NAME
        and _IDENTIFIER.fullmatch(name) is not None
        and not keyword.iskeyword(name)
        and not name.startswith("__")
    )


def is_segment(name: Any) -> bool:
    """One part of a module, parameter or buffer path, as PyTorch names one: a non-empty string without `.`
    (any other spelling: codegen.py writes it through a generated identifier), at most MAX_NAME characters."""
    return isinstance(name, str) and 0 < len(name) <= MAX_NAME and "." not in name


def is_path(path: Any) -> bool:
    """A dotted module/attribute path of at most MAX_SEGMENTS segments, each a segment."""
    if not isinstance(path, str) or not path or len(path) > MAX_SEGMENTS * (MAX_NAME + 1):
        return False
    parts = path.split(".")
    return len(parts) <= MAX_SEGMENTS and all(is_segment(p) for p in parts)


def is_class_name(name: Any) -> bool:
    """A stored class name: data fx only sets as the class's `__name__` (no NUL, which Python refuses there)."""
    return isinstance(name, str) and 0 < len(name) <= MAX_NAME and "\0" not in name


def to_identifier(text: str) -> str:
    """An identifier made from `text` (for names graphgrow generates from paths): other characters → `_`."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", text)[: MAX_NAME - 8]
    if not name or name[0].isdigit():
        name = "_" + name
    if name.startswith("__"):
        name = "m" + name.lstrip("_") if name.strip("_") else "m"
    if name[0].isdigit():
        name = "_" + name
    return name + "_" if keyword.iskeyword(name) else name


def shown(name: Any) -> str:
    """A hostile name as it may appear in a one-line message: repr'd (no newlines), cut."""
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


def bad_name_in_tree(root: nn.Module) -> str | None:
    """The first module, parameter or buffer name under `root` PyTorch would not register (shown, with why), or None.

    Iterative and bounded: a hostile tree may nest deeply or share children in a lattice."""
    seen: set[int] = set()
    todo: list[tuple[str, nn.Module]] = [("", root)]
    while todo:
        prefix, module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if len(seen) > MAX_MODULES:
            return f"more than {MAX_MODULES:,} modules"
        for table, what in (
            (module._parameters, "parameter"),
            (module._buffers, "buffer"),
            (module._modules, "module"),
        ):
            for key in table:
                if not isinstance(key, str):
                    return f"{what} key {shown(key)} is not a string"
                if not is_segment(key):
                    return f"{what} {shown(prefix + key)} is empty, holds a '.' or is longer than {MAX_NAME} characters"
                if key in module.__dict__ or hasattr(type(module), key):
                    return (
                        f"{what} {shown(prefix + key)} is named like an attribute of its module "
                        "(PyTorch refuses such names)"
                    )
        for key, child in module._modules.items():
            if child is not None:
                todo.append((f"{prefix}{key}.", child))
    return None


def bad_name_in_record(rec: dict[str, Any]) -> str | None:
    """The first unusable name of one stored node record (shown, with why), or None. Node names, module paths and
    scopes are data (any string of bounded length); input and method names are identifiers in the code."""
    op, target = rec.get("op"), rec.get("target")
    if not isinstance(rec.get("name"), str) or not 0 < len(rec["name"]) <= MAX_NAME:
        return f"node name {shown(rec.get('name'))} is not a string of 1 to {MAX_NAME} characters"
    if op == "placeholder" and (not is_identifier(target) or target == "self"):
        return f"input name {shown(target)} is not a plain name ({RULE})"
    if op == "output" and target != "output":
        return f"output target {shown(target)} is not 'output'"
    if op in ("get_attr", "call_module") and not is_path(target):
        return (
            f"module path {shown(target)} is not a path of at most {MAX_SEGMENTS} names of 1 to {MAX_NAME} characters"
        )
    if op == "call_method" and not is_identifier(target):
        return f"method name {shown(target)} is not a plain name ({RULE})"
    scope = rec.get("scope", ())
    if not isinstance(scope, (list, tuple)) or len(scope) > MAX_SEGMENTS:
        return "scope (not a short list of module paths)"
    for path in scope:  # fx's module-stack keys: a path, `@N` for the N-th call of the same module; shown, never run
        if not (isinstance(path, str) and len(path) <= MAX_SEGMENTS * (MAX_NAME + 1) + 12):
            return f"scope path {shown(path)} is not a module path"
    return None


def bad_keywords(kwargs: Any) -> str | None:
    """fx writes keyword arguments as `key = value`: every key must be an identifier."""
    if not isinstance(kwargs, dict):
        return "keyword arguments (not a record)"
    for key in kwargs:
        if not is_identifier(key):
            return f"keyword argument {shown(key)} is not a plain name ({RULE})"
    return None


# ---- the second wall: the generated forward, parsed before it is compiled ------------------

_ALLOWED_NODES = (
    ast.Module,
    ast.FunctionDef,
    ast.arguments,
    ast.arg,
    ast.Assign,
    ast.Return,
    ast.Expr,
    ast.Name,
    ast.Load,
    ast.Store,
    ast.Attribute,
    ast.Call,
    ast.keyword,
    ast.Constant,
    ast.Tuple,
    ast.List,
    ast.Dict,
    ast.Subscript,
    ast.Slice,
    ast.Starred,
    ast.BinOp,
    ast.UnaryOp,
    ast.Compare,
    ast.operator,
    ast.unaryop,
    ast.cmpop,
)
# fx writes these builtins bare: getattr for non-identifier path segments, slice/complex for constants, Ellipsis
# for `x[..., :n]`
_FX_BUILTINS = frozenset({"getattr", "slice", "complex", "Ellipsis"})


def check_source(graph: fx.Graph) -> str | None:
    """What is wrong with the forward fx would generate for `graph` (None when it is only fx's own forms)."""
    code = graph.python_code(root_module="self")
    try:
        tree = ast.parse(code.src)
    except SyntaxError as e:
        return f"the generated code does not parse ({e.msg})"
    if not tree.body:
        return "the generated code is empty"
    *wraps, fn = tree.body
    if not isinstance(fn, ast.FunctionDef) or fn.name != "forward" or fn.decorator_list:
        return "the generated code is not one plain forward function"
    if not all(_is_fx_wrap(w, code.globals) for w in wraps):
        return "the generated code holds a statement outside the forward function"
    if fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or fn.args.posonlyargs or fn.args.defaults:
        return "the generated forward has an unexpected signature"
    params = [a.arg for a in fn.args.args]
    if params[:1] != ["self"]:
        return "the generated forward has an unexpected signature"
    used_globals = set(code.globals) | _FX_BUILTINS | _bare_builtins(graph)
    known = set(params) | used_globals
    clash = set(params[1:]) & used_globals
    if clash:
        return f"an input is named like a global ({', '.join(sorted(clash))})"
    annotations = [a.annotation for a in fn.args.args if a.annotation is not None] + (
        [fn.returns] if fn.returns else []
    )
    for expr in annotations:  # fx writes traced type hints: names of globals it registered
        if (problem := _check_expression(ast.Expr(expr), known)) is not None:
            return problem
    for stmt in fn.body:
        if isinstance(stmt, ast.Assign):
            if not all(isinstance(t, ast.Name) for t in stmt.targets):
                return "the generated code assigns to something other than a name"
            known.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif not isinstance(stmt, (ast.Return, ast.Expr)):
            return f"the generated code holds a {type(stmt).__name__} statement"
        if (problem := _check_expression(stmt, known)) is not None:
            return problem
    return None


def _check_expression(stmt: ast.AST, known: set[str]) -> str | None:
    for sub in ast.walk(stmt):
        if not isinstance(sub, _ALLOWED_NODES):
            return f"the generated code holds a {type(sub).__name__} expression"
        if isinstance(sub, ast.Attribute) and sub.attr.startswith("__"):
            return f"the generated code reads the attribute {shown(sub.attr)}"
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in known:
            return f"the generated code names {shown(sub.id)}, which the graph does not define"
        if isinstance(sub, ast.keyword) and sub.arg is None:
            return "the generated code unpacks keyword arguments"
    return None


def _is_fx_wrap(stmt: Any, fx_globals: dict[str, Any]) -> bool:
    """fx's module-level `torch.fx._symbolic_trace.wrap("NAME")` for a wrapped function it registered as a global."""
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and not stmt.value.keywords
        and ast.unparse(stmt.value.func) == "torch.fx._symbolic_trace.wrap"
        and len(stmt.value.args) == 1
        and isinstance(arg := stmt.value.args[0], ast.Constant)
        and isinstance(arg.value, str)
        and arg.value in fx_globals
    )


def _bare_builtins(graph: fx.Graph) -> set[str]:
    """Builtins the graph calls (fx writes them by their bare name, e.g. `len`)."""
    return {
        getattr(n.target, "__name__", "")
        for n in graph.nodes
        if n.op == "call_function" and getattr(n.target, "__module__", None) == "builtins"
    }
