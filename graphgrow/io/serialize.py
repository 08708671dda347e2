"""GraphModule ↔ a plain structure that torch.load(weights_only=True) can read.

A pickled GraphModule re-executes generated Python code when loaded, so graphgrow
never writes one. Instead it saves the module tree (standard layers only), the graph
as data, and resolves call_function targets by name against an allow-list when
loading, so a crafted file cannot name `os.system` and have it called.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from ..core import codegen, names
from ..core.errors import InputError, LoadError, SaveError, escape_controls
from ..graph.inputs import parse_spec, records
from . import graph_policy
from .lineage import is_origin

FORMAT = "graphgrow.graphmodule"
VERSION = 1

MAX_NODES = 200_000  # far beyond any real model; a bound on what a file can make us build
MAX_LOG_ENTRIES = 1_000
MAX_META_DEPTH = 12


def qualified_name(fn: Callable[..., Any]) -> str:
    if getattr(fn, "__module__", None) == "_operator":
        return f"operator.{fn.__name__}"
    if (
        getattr(fn, "__module__", None) == "builtins"
    ):  # torch.fx names builtins bare ("len"); the allow-list and loader want builtins.len
        return f"builtins.{fn.__name__}"
    return fx.node._get_qualified_name(fn)


def _resolve_function(qualname: str, trusted: bool, node: str = "?") -> Callable[..., Any]:
    if not trusted:
        graph_policy.check_function(qualname, node)
    if not isinstance(qualname, str) or not re.fullmatch(r"[A-Za-z_][\w.]*", qualname):
        raise LoadError(f"the model graph names the function {str(qualname)[:80]!r}", "the file is corrupted")
    module_name, _, attr = qualname.rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError:
        # nested attributes such as torch._C._nn.gelu
        head, _, rest = module_name.partition(".")
        try:
            obj = importlib.import_module(head)
            for part in rest.split(".") if rest else []:
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            obj = None
    fn: Callable[..., Any] | None = getattr(obj, attr, None)
    if not callable(fn):
        raise LoadError(
            f"the model graph calls '{qualname}', which does not exist here", "was it saved by a newer torch?"
        )
    return fn


def _encode(value: Any, where: str) -> Any:
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, torch.Size)):
        return {"tuple": [_encode(v, where) for v in value]}
    if isinstance(value, list):
        return [_encode(v, where) for v in value]
    if isinstance(value, dict):
        return {"dict": [[k, _encode(v, where)] for k, v in value.items()]}
    if isinstance(value, slice):
        return {"slice": [_encode(value.start, where), _encode(value.stop, where), _encode(value.step, where)]}
    if value is Ellipsis:
        return {"ellipsis": True}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    raise SaveError(
        f"cannot save the model: node '{where}) has an argument of type {type(value).__name__}, which "
        "graphgrow files cannot store (plain numbers, strings, tuples, lists, dicts, slices, dtypes, devices)",
        "mark the module that computes it a leaf (--leaf MODULE)",
    )


def _decode(value: Any, env: dict[str, fx.Node]) -> Any:
    if isinstance(value, list):
        return [_decode(v, env) for v in value]
    if not isinstance(value, dict):
        return value
    ((tag, payload),) = value.items()
    if tag == "node":
        return env[payload]
    if tag == "tuple":
        return tuple(_decode(v, env) for v in payload)
    if tag == "dict":
        return {k: _decode(v, env) for k, v in payload}
    if tag == "slice":
        return slice(*(_decode(v, env) for v in payload))
    if tag == "ellipsis":
        return Ellipsis
    if tag in ("dtype", "memory_format", "layout"):
        obj = getattr(torch, payload, None)
        if not isinstance(obj, (torch.dtype, torch.memory_format, torch.layout)):
            raise LoadError(f"unknown torch {tag} '{payload}' in the model graph")
        return obj
    if tag == "device":
        return torch.device(payload)
    raise LoadError(f"unknown value tag '{tag}' in the model graph", "the file is corrupted or from a newer graphgrow")


def to_payload(gm: fx.GraphModule) -> dict[str, Any]:
    """The saveable form of a GraphModule: module tree, graph as data, graphgrow meta."""
    root = nn.Module()
    for name, child in gm.named_children():
        root.add_module(name, child)
    for name, p in gm.named_parameters(recurse=False):
        root.register_parameter(name, p)
    for name, b in gm.named_buffers(recurse=False):
        root.register_buffer(name, b)
    for n in gm.graph.nodes:
        if n.op == "get_attr" and "." not in n.target and not hasattr(root, n.target):
            setattr(root, n.target, getattr(gm, n.target))  # a plain tensor or number attribute
    nodes = node_records(gm.graph)
    problem = names.bad_name_in_tree(root) or next(filter(None, map(names.bad_name_in_record, nodes)), None)
    if problem is None and not names.is_class_name(type(gm).__name__):
        problem = f"class name {names.shown(type(gm).__name__)} is not a string of 1 to {names.MAX_NAME} characters"
    if problem:  # never write a file that would be refused when read back
        raise SaveError(f"cannot save the model: its {problem}", "rename it in the model, then grow it again")
    check_readable(gm.graph, root, nodes)
    meta = dict(gm.meta.get("graphgrow", {}))
    training = {path: m.training for path, m in gm.named_modules()}
    return {
        "format": FORMAT,
        "version": VERSION,
        "class_name": type(gm).__name__,
        "root": root,
        "nodes": nodes,
        "meta": meta,
        "training": training,
    }


_OWN_NAMESPACES = frozenset({"torch", "operator", "math", "builtins", "torchvision"})  # what the closed list covers


def check_readable(graph: fx.Graph, root: nn.Module, nodes: list[dict[str, Any]]) -> None:
    """Never write a graph graphgrow would refuse to read back: each node is checked as the loader checks it
    (graph_policy), now, and refused with a SaveError naming it. One exception, as for custom classes: a function
    of an installed package outside torch (the user's own code, called through by the trace) is written, and
    reading the file back needs --trust."""
    for n, rec in zip(graph.nodes, nodes):
        target = rec["target"]
        try:
            if n.op == "call_function":
                _found_again(target, n.name)
                if target.partition(".")[0] not in _OWN_NAMESPACES:
                    continue
            graph_policy.check_node_record(rec, root)
            if n.op in ("call_function", "call_method"):
                graph_policy.check_sizes(str(target), n.args, n.kwargs, n.name)
            if n.op == "call_function" and n.target is getattr:
                graph_policy.check_getattr_args(n.args, n.name)
        except LoadError as e:  # the loader's reason, said of saving
            why = e.message.removeprefix(f"the model graph (node '{n.name}') ").partition("; nothing was run")[0]
            raise SaveError(
                f"cannot save the model: node '{n.name}' {why}, so graphgrow could not read the file back",
                "mark the module that computes it a leaf (--leaf MODULE), or report the operation to "
                "graphgrow so that it can be reviewed for its closed list",
            ) from e


def _found_again(qualname: str, node: str) -> None:
    """A function is stored by its qualified name: the loader must find it again by that name (trust or not)."""
    try:
        _resolve_function(qualname, True, node)
    except LoadError as e:
        raise SaveError(
            f"cannot save the model: node '{node}' calls '{qualname[:120]}', which cannot be found again by "
            "that name (a lambda or a local function?)",
            _UNNAMED_HINT,
        ) from e


_UNNAMED_HINT = "make it a module-level function, or mark the module that calls it a leaf (--leaf MODULE)"


def node_records(graph: fx.Graph) -> list[dict[str, Any]]:
    """The graph as plain records (names, targets by qualified name, arguments as data). SaveError for a
    function that has no importable name (a lambda, a local function) or a constant that is not plain data."""
    nodes = []
    for n in graph.nodes:
        try:
            target = qualified_name(n.target) if n.op == "call_function" else n.target
        except Exception as e:  # fx cannot name lambdas and local functions
            raise SaveError(
                f"cannot save the model: node '{n.name}' calls {str(n.target)[:120]}, which has no importable "
                f"name (a lambda or a local function?): {e}",
                _UNNAMED_HINT,
            ) from e
        where = f"{n.name}' ({target}"
        nodes.append(
            {
                "name": n.name,
                "op": n.op,
                "target": target,
                "args": _encode(n.args, where),
                "kwargs": _encode(n.kwargs, where),
                "scope": list(n.meta.get("gg_scope", ())),
            }
        )
    return nodes


def graph_from_records(nodes: Any, root: nn.Module, trusted: bool) -> fx.Graph:
    """Rebuild a graph from `node_records` output: every name and (unless trusted) every node checked
    before anything is built, functions resolved by name against the allow-list, the code fx would
    generate parsed before it is compiled. Raises LoadError."""
    if not isinstance(nodes, list) or len(nodes) > MAX_NODES:
        raise LoadError(
            f"the saved graph is not a list of at most {MAX_NODES:,} nodes", "the file is corrupted or hostile"
        )
    for rec in nodes:
        if not isinstance(rec, dict) or not {"name", "op", "target", "args", "kwargs"} <= rec.keys():
            raise LoadError("the saved graph holds a node that is not a complete record", "the file is corrupted")
        if (problem := names.bad_name_in_record(rec)) is not None:
            raise _bad_name(problem, rec.get("name"))
    if not trusted:  # the whole graph is checked before any of it is built or run
        for rec in nodes:
            graph_policy.check_node_record(rec, root)
    graph = codegen.adopt(fx.Graph())  # module paths reach the code through generated identifiers only
    env: dict[str, fx.Node] = {}
    try:
        for rec in nodes:
            op, target = rec["op"], rec["target"]
            args, kwargs = _decode(rec["args"], env), _decode(rec["kwargs"], env)
            if (problem := names.bad_keywords(kwargs)) is not None:
                raise _bad_name(problem, rec["name"])
            if not trusted and op in ("call_function", "call_method"):
                graph_policy.check_sizes(str(target), args, kwargs, rec["name"])
            if op == "call_function":
                target = _resolve_function(target, trusted, rec["name"])
                if target is getattr and not trusted:
                    graph_policy.check_getattr_args(args, rec["name"])
                if (
                    target is getattr
                    and len(args) > 1
                    and isinstance(args[1], str)
                    and not names.is_identifier(args[1])
                ):
                    raise _bad_name(
                        f"attribute name {names.shown(args[1])} is not a plain name ({names.RULE})", rec["name"]
                    )
            # a stored node name that is not a plain identifier is data: the node gets a generated one
            node = graph.create_node(
                op, target, args, kwargs, name=rec["name"] if names.is_identifier(rec["name"]) else "node"
            )
            node.meta["gg_scope"] = tuple(rec.get("scope", ()))
            env[rec["name"]] = node
        graph.lint()
        problem = names.check_source(graph)  # the second wall, before anything is compiled
    except LoadError:
        raise
    except Exception as e:  # fx cannot even write the code of some malformed graphs (a method call without self)
        raise LoadError(
            escape_controls(f"the saved graph is inconsistent: {e}"),
            "the file is corrupted; re-create it from the original model",
        ) from e
    if problem is not None:
        raise LoadError(
            f"the saved graph would generate unexpected code: {problem}; nothing was run",
            "the file was edited by hand or is hostile; re-create it from the original model",
        )
    return graph


def from_payload(payload: dict[str, Any], trusted: bool = False) -> fx.GraphModule:
    """Rebuild a GraphModule from `to_payload` output, resolving functions safely (load.py has counted the nodes of
    the whole file, mode switches' bodies included, before this builds any)."""
    if payload.get("version") != VERSION:
        raise LoadError(
            f"graphgrow file format version {payload.get('version')} is not supported (this graphgrow reads {VERSION})"
        )
    root, nodes = payload.get("root"), payload.get("nodes")
    if not isinstance(root, nn.Module) or not isinstance(nodes, list):
        raise LoadError("the graphgrow file has no module tree or no graph", "the file is corrupted; re-create it")
    if len(nodes) > MAX_NODES:
        raise LoadError(
            f"the saved graph has {len(nodes):,} nodes (limit {MAX_NODES:,})", "the file is corrupted or hostile"
        )
    # Names first, trusted or not: no stored string reaches the code fx generates (names.py)
    _check_names(payload, nodes, root)
    meta = validate_meta(payload.get("meta"))
    graph = graph_from_records(nodes, root, trusted)
    try:
        gm = fx.GraphModule(payload["root"], graph, payload.get("class_name", "GraphModule"))
    except Exception as e:
        raise LoadError(
            escape_controls(f"the saved graph is inconsistent: {e}"),
            "the file is corrupted; re-create it from the original model",
        ) from e
    for sub in gm.modules():  # graphgrow's mode switches hold small graphs of their own, checked the same way
        if hasattr(sub, "load_bodies"):
            sub.load_bodies(trusted)
    gm.meta["graphgrow"] = meta
    _restore_modes(gm, payload.get("training"))
    return gm


def _bad_name(problem: str, node: Any) -> LoadError:
    where = f" (node {names.shown(node)})" if isinstance(node, str) and not problem.startswith("node name") else ""
    return LoadError(
        f"the saved model's {problem}{where}; nothing was run",
        "the file was edited by hand or is hostile; re-create it from the original model",
    )


def _check_names(payload: dict[str, Any], nodes: list[Any], root: nn.Module) -> None:
    """Every name the file supplies — module tree, node records, class name — before anything is built."""
    if (problem := names.bad_name_in_tree(root)) is not None:
        raise _bad_name(problem, None)
    for rec in nodes:
        if not isinstance(rec, dict) or not {"name", "op", "target", "args", "kwargs"} <= rec.keys():
            raise LoadError("the saved graph holds a node that is not a complete record", "the file is corrupted")
        if (problem := names.bad_name_in_record(rec)) is not None:
            raise _bad_name(problem, rec.get("name"))
    if not names.is_class_name(payload.get("class_name", "GraphModule")):
        raise _bad_name(
            f"class name {names.shown(payload.get('class_name'))} is not a string of 1 to {names.MAX_NAME} characters",
            None,
        )


def _restore_modes(gm: fx.GraphModule, flags: Any) -> None:
    """Put back every module's training flag as saved (older files have none: left as loaded)."""
    if not isinstance(flags, dict):
        return
    for path, m in gm.named_modules():
        flag = flags.get(path)
        if isinstance(flag, bool):
            m.training = flag


MAX_META_ITEMS = 100_000  # list/tuple elements and dict entries in all the metadata, each time one is reached
MAX_META_TEXT = 4 << 20  # characters of all its strings and keys, likewise


def _too_large(value: Any) -> str | None:
    """What is too large in plain data, stopping as soon as it is (no recursion). A pickle stores a list once however
    often it is used, so every use counts: a few hundred KB can otherwise name more items than memory holds."""
    items, text, todo = 0, 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            text += len(v)
        elif isinstance(v, dict):
            items += len(v)
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            items += len(v)
            todo.extend(v)
        if items > MAX_META_ITEMS:
            return f"holds more than {MAX_META_ITEMS:,} list items and record fields"
        if text > MAX_META_TEXT:
            return f"holds more than {MAX_META_TEXT >> 20} MiB of text"
    return None


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of plain data, stopping past `limit` (no recursion: a hostile file may nest deeply)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(v, dict):
            todo.extend((x, d + 1) for x in v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend((x, d + 1) for x in v)
    return deepest


def is_stored_shape(shape: Any) -> bool:
    """A stored example input shape graphgrow accepts: 1–8 positive int sizes of at most 2^20 each."""
    return (
        isinstance(shape, (list, tuple))
        and 1 <= len(shape) <= 8
        and all(type(d) is int and 0 < d <= 1 << 20 for d in shape)
    )


def validate_meta(meta: Any) -> dict[str, Any]:
    """graphgrow's stored metadata is untrusted: check its types and sizes; return a clean copy."""
    from .meta_schema import check_log, check_trace

    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise LoadError("the graphgrow file's metadata is not a record", "the file is corrupted")
    if (problem := _too_large(meta)) is not None:  # before anything else walks it
        raise LoadError(f"the graphgrow file's metadata {problem}", "the file is corrupted or hostile")
    out = dict(meta)
    shape = out.get("input_shape")
    if shape is not None:
        if not is_stored_shape(shape):
            raise LoadError(
                f"the graphgrow file stores the input shape {str(shape)[:80]}, which is not a shape",
                "pass --input-shape N,C,H,W, or re-create the file",
            )
        out["input_shape"] = list(shape)
    log = out.get("log", [])
    if not isinstance(log, list) or len(log) > MAX_LOG_ENTRIES or not all(isinstance(e, dict) for e in log):
        raise LoadError(
            f"the graphgrow file's mutation log is malformed (a list of at most {MAX_LOG_ENTRIES} records expected)",
            "the file is corrupted or hostile",
        )
    if _depth(log, MAX_META_DEPTH) > MAX_META_DEPTH or _depth(out.get("trace"), MAX_META_DEPTH) > MAX_META_DEPTH:
        raise LoadError("the graphgrow file's metadata is nested too deeply", "the file is corrupted or hostile")
    check_log(log, "the stored mutation log")  # each field its readers use, of its type
    check_trace(out.get("trace"), "the stored trace report")
    out["log"] = log
    if "origin" in out and not is_origin(out["origin"]):
        raise LoadError("the graphgrow file's origin fingerprint is malformed", "the file is corrupted or hostile")
    if (
        out.get("inputs") is not None
    ):  # the example input (graph_meta.input_spec_of reads it, or an older `input_shape`)
        out["inputs"] = stored_inputs(out["inputs"])
    return out


MAX_HIGH = 1 << 40  # an integer input's stored exclusive bound (a vocabulary size)


def stored_inputs(value: Any) -> list[dict[str, Any]]:
    """A stored input spec (graph_meta.store_shape's records) read back: names, shapes, dtypes and bounds
    checked by the spec's own parser (graph.inputs: identifiers, bounded shapes, known dtypes); clean records."""
    ok = (
        isinstance(value, list)
        and 0 < len(value) <= 64
        and all(
            isinstance(r, dict)
            and type(r.get("name")) is str
            and isinstance(r.get("shape"), list)
            and len(r["shape"]) <= 8
            and all(type(d) is int for d in r["shape"])
            and type(r.get("dtype", "float32")) is str
            and (r.get("high") is None or (type(r.get("high")) is int and 0 < r["high"] <= MAX_HIGH))
            and (r.get("last") is None or (type(r.get("last")) is int and 0 <= r["last"] < MAX_HIGH))
            for r in value
        )
    )
    try:
        if ok:
            return records(parse_spec(value))
        why = "not a list of input records (name, shape, dtype, high)"
    except InputError as e:
        why = e.message
    raise LoadError(
        f"the graphgrow file stores a malformed input spec: {why[:200]}",
        "the file is corrupted or hostile; re-create it",
    )
