"""GraphModule ↔ a plain structure that torch.load(weights_only=True) can read.

A pickled GraphModule re-executes generated Python code when loaded, so graphgrow
never writes one. Instead it saves the module tree (standard layers only), the graph
as data, and resolves call_function targets by name against an allow-list when
loading, so a crafted file cannot name `os.system` and have it called.
"""
from __future__ import annotations

import importlib
import types
from typing import Any, Callable

import torch
from torch import fx, nn

from .errors import LoadError, SaveError

FORMAT = "graphgrow.graphmodule"
VERSION = 1

# Modules whose callables may appear as call_function targets in an untrusted file.
_SAFE_FUNCTION_MODULES = {"operator", "math", "torch.nn.functional", "torch._C._nn", "torch._C._fft", "torch._C._linalg", "torch._C._special"}
_SAFE_FUNCTIONS = {
    "builtins.getattr", "torch._assert", "torch.fx._symbolic_trace._assert_is_none",
    "torch.functional.split", "torch.functional.einsum", "torch.functional.norm",
    "torch.functional.broadcast_tensors", "torch.functional.meshgrid",
    "torchvision.ops.stochastic_depth.stochastic_depth",
}


def qualified_name(fn: Callable) -> str:
    if getattr(fn, "__module__", None) == "_operator":
        return f"operator.{fn.__name__}"
    if fn is getattr:
        return "builtins.getattr"
    return fx.node._get_qualified_name(fn)


def _resolve_function(qualname: str, trusted: bool) -> Callable:
    module_name, _, attr = qualname.rpartition(".")
    allowed = (
        trusted
        or qualname in _SAFE_FUNCTIONS
        or module_name in _SAFE_FUNCTION_MODULES
        or (module_name == "torch" and isinstance(getattr(torch, attr, None), types.BuiltinFunctionType))
    )
    if not allowed:
        raise LoadError(
            f"the model graph calls '{qualname}', which is not on graphgrow's list of safe functions",
            "load it with --trust only if you trust where the file came from",
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError:
        # nested attributes such as torch._C._nn.gelu
        head, _, rest = module_name.partition(".")
        obj = importlib.import_module(head)
        for part in rest.split(".") if rest else []:
            obj = getattr(obj, part)
    fn = getattr(obj, attr, None)
    if not callable(fn):
        raise LoadError(f"the model graph calls '{qualname}', which does not exist here", "was it saved by a newer torch?")
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
    raise SaveError(f"node '{where}' has an argument of type {type(value).__name__} that graphgrow cannot save")


def _decode(value: Any, env: dict[str, fx.Node]) -> Any:
    if isinstance(value, list):
        return [_decode(v, env) for v in value]
    if not isinstance(value, dict):
        return value
    (tag, payload), = value.items()
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


def to_payload(gm: fx.GraphModule) -> dict:
    """The saveable form of a GraphModule: module tree, graph as data, graphgrow meta."""
    root = nn.Module()
    for name, child in gm.named_children():
        root.add_module(name, child)
    for name, p in gm.named_parameters(recurse=False):
        root.register_parameter(name, p)
    for name, b in gm.named_buffers(recurse=False):
        root.register_buffer(name, b)
    nodes = []
    for n in gm.graph.nodes:
        if n.op == "get_attr" and "." not in n.target and not hasattr(root, n.target):
            setattr(root, n.target, getattr(gm, n.target))  # a plain tensor attribute
        target = qualified_name(n.target) if n.op == "call_function" else n.target
        nodes.append({
            "name": n.name, "op": n.op, "target": target,
            "args": _encode(n.args, n.name), "kwargs": _encode(n.kwargs, n.name),
            "scope": list(n.meta.get("gg_scope", ())),
        })
    meta = dict(gm.meta.get("graphgrow", {}))
    return {"format": FORMAT, "version": VERSION, "class_name": type(gm).__name__, "root": root, "nodes": nodes, "meta": meta}


def from_payload(payload: dict, trusted: bool = False) -> fx.GraphModule:
    """Rebuild a GraphModule from `to_payload` output, resolving functions safely."""
    if payload.get("version") != VERSION:
        raise LoadError(f"graphgrow file format version {payload.get('version')} is not supported (this graphgrow reads {VERSION})")
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    try:
        for rec in payload["nodes"]:
            op, target = rec["op"], rec["target"]
            if op == "call_function":
                target = _resolve_function(target, trusted)
            node = graph.create_node(op, target, _decode(rec["args"], env), _decode(rec["kwargs"], env), name=rec["name"])
            node.meta["gg_scope"] = tuple(rec.get("scope", ()))
            env[rec["name"]] = node
        graph.lint()
        gm = fx.GraphModule(payload["root"], graph, payload.get("class_name", "GraphModule"))
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"the saved graph is inconsistent: {e}", "the file is corrupted; re-create it from the original model") from e
    gm.meta["graphgrow"] = dict(payload.get("meta") or {})
    gm.meta["graphgrow"].setdefault("log", [])
    gm.meta["graphgrow"].setdefault("input_shape", None)
    return gm
