"""Complex arithmetic as real pairs, for ONNX export: ONNX has no complex tensor type.

Rotary embeddings written with complex numbers (DeepSeek-V2, LLaMA's reference code: `view_as_complex(x) *
polar(1, θ)`, then `view_as_real`) fail in torch.onnx ("No decompositions registered for the complex-valued
input"). `real_pairs` rewrites a copy of the graph so that every complex tensor is held as the real tensor
`view_as_real` would give (its real and imaginary parts on a last axis of 2) and every op on it is the real
arithmetic it stands for: view_as_complex and view_as_real become nothing, (a+bi)(c+di) = (ac−bd) + (ad+bc)i,
polar(r, θ) = (r·cos θ, r·sin θ), and shape ops keep the pair axis last. An op on complex values without such a
rule is an ExportError naming it (the model itself is unchanged; only the export is refused). The equivalence
check compares the exported model with the original graph, so the rewrite is checked on every export.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import fx

from ..core.errors import ExportError
from ..graph import ops

aten = torch.ops.aten

TO_COMPLEX = {aten.view_as_complex.default, torch.view_as_complex}
TO_REAL = {aten.view_as_real.default, torch.view_as_real}
POLAR = {aten.polar.default, torch.polar}
MUL = ops.PRODUCT_FUNCTIONS | {aten.mul.Tensor, "mul"}
ADD = ops.SUM_FUNCTIONS | {aten.add.Tensor, "add"}
SUB = ops.DIFFERENCE_FUNCTIONS | {aten.sub.Tensor, "sub"}
UNSQUEEZE = {torch.unsqueeze, aten.unsqueeze.default, "unsqueeze"}
RESHAPE = {torch.reshape, aten.reshape.default, aten.view.default, "reshape", "view"}
SAME = ops.COPIES | {"detach", torch.clone, aten.clone.default, aten.contiguous.default}
GETITEM = {operator.getitem}
AT_DIM = {aten.slice.Tensor, aten.select.int, aten.narrow.default, torch.select, torch.narrow, "select", "narrow"}
CAST = {"to", "type"}
REAL_OF = {torch.float32: torch.complex64, torch.float64: torch.complex128}


class ComplexUnsupported(ExportError):
    """The model computes with complex values in a way ONNX cannot hold and the rewrite does not cover: a refusal of
    the export, stated (exit 2), not a failed check."""

    exit_code = 2


def has_complex(gm: torch.nn.Module) -> bool:
    """Whether `gm`'s graph makes a complex tensor (from real ones: the model's inputs are real)."""
    return isinstance(gm, fx.GraphModule) and any(_target(n) in TO_COMPLEX | POLAR for n in gm.graph.nodes)


def real_pairs(gm: torch.nn.Module) -> torch.nn.Module:
    """`gm` itself when it makes no complex tensor, else a GraphModule sharing its modules and parameters whose graph
    holds every complex tensor as a real pair (last axis 2). ExportError names an op on complex values it cannot
    rewrite, or a complex output (ComplexUnsupported)."""
    if not has_complex(gm):
        return gm
    assert isinstance(gm, fx.GraphModule)
    graph = copy.deepcopy(gm.graph)
    pairs: set[fx.Node] = set()  # nodes that now hold a complex value as a real pair
    for n in list(graph.nodes):
        inputs = [a for a in n.all_input_nodes if a in pairs]
        if n.op == "output":
            if inputs:
                raise ComplexUnsupported(
                    "the model returns a complex tensor, which ONNX has no type for",
                    "return torch.view_as_real(z) from the model instead",
                )
            continue
        target = _target(n)
        if not inputs and target not in TO_COMPLEX | POLAR:
            continue
        with graph.inserting_before(n):
            new = _rewrite(graph, n, target, pairs)
        if new is not n:
            n.replace_all_uses_with(new)
            graph.erase_node(n)
        if target not in TO_REAL:
            pairs.add(new)
    graph.lint()
    return fx.GraphModule(gm, graph)


def _target(n: fx.Node) -> Any:
    return n.target if n.op in ("call_function", "call_method") else None


def _rewrite(graph: fx.Graph, n: fx.Node, target: Any, pairs: set[fx.Node]) -> fx.Node:
    """The node computing `n` on real pairs (`n` itself where the pair is already its value)."""
    f = graph.call_function
    args = list(n.args)
    if target in TO_COMPLEX or target in TO_REAL:
        # view_as_complex(x) is x, view_as_real(z) is z's pair; a node of its own (an Identity in ONNX), so that one
        # node never stands for a real tensor and a pair at once
        return f(torch.clone, (args[0],))
    if target in SAME:
        assert isinstance(args[0], fx.Node)
        return args[0]
    if target in CAST:
        dtype = args[1] if len(args) > 1 else n.kwargs.get("dtype")
        if isinstance(dtype, torch.dtype) and dtype.is_complex and len(args) <= 2 and set(n.kwargs) <= {"dtype"}:
            real = next(r for r, c in REAL_OF.items() if c == dtype)
            return f(torch.Tensor.to, (args[0], real))
        _refuse(n)
    if target in POLAR:
        r, theta = args
        parts = [f(operator.mul, (r, f(trig, (theta,)))) for trig in (torch.cos, torch.sin)]
        return f(torch.stack, (parts, -1))
    if target in UNSQUEEZE and not n.kwargs:
        dim = args[1]
        return f(torch.unsqueeze, (args[0], dim - 1 if dim < 0 else dim))
    if target in GETITEM and args[0] in pairs:
        return f(operator.getitem, (args[0], _pair_index(args[1])))
    if target in AT_DIM and not n.kwargs and len(args) >= 2 and isinstance(args[1], int):
        # slice/select/narrow along one dim: a negative dim counts from the end, past the pair axis now
        at = (args[0], args[1] - 1 if args[1] < 0 else args[1], *args[2:])
        return graph.call_method(target, at) if n.op == "call_method" else f(target, at)
    if target in RESHAPE and not n.kwargs:
        shape = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        return f(torch.reshape, (args[0], [*shape, 2]))
    if target in MUL and len(args) == 2 and not n.kwargs:
        return _mul(f, n, args[0], args[1], pairs)
    if (target in ADD or target in SUB) and len(args) == 2 and not n.kwargs and all(a in pairs for a in args):
        return f(operator.add if target in ADD else operator.sub, tuple(args))
    _refuse(n)


def _pair_index(index: Any) -> Any:
    """z[index] on the pair: the index reaches the complex dims only, so the pair axis after them is kept whole. An
    index without an Ellipsis leaves the trailing (pair) axis alone as it stands; one with an Ellipsis would let
    it cover the pair axis, so a full slice for that axis goes after it."""
    items = index if isinstance(index, tuple) else (index,)
    return (*items, slice(None)) if any(i is Ellipsis for i in items) else index


def _mul(f: Callable[..., fx.Node], n: fx.Node, a: Any, b: Any, pairs: set[fx.Node]) -> fx.Node:
    """(a+bi)(c+di) = (ac − bd) + (ad + bc)i; a complex pair times a real tensor scales both parts alike."""
    if a in pairs and b in pairs:
        ar, ai, br, bi = (f(operator.getitem, (t, (Ellipsis, i))) for t in (a, b) for i in (0, 1))
        re = f(operator.sub, (f(operator.mul, (ar, br)), f(operator.mul, (ai, bi))))
        im = f(operator.add, (f(operator.mul, (ar, bi)), f(operator.mul, (ai, br))))
        return f(torch.stack, ([re, im], -1))
    z, r = (a, b) if a in pairs else (b, a)
    if isinstance(r, (int, float)) and not isinstance(r, bool):
        return f(operator.mul, (z, r))
    if isinstance(r, fx.Node):  # a real tensor: broadcast over the pair axis
        return f(operator.mul, (z, f(torch.unsqueeze, (r, -1))))
    _refuse(n)


def _refuse(n: fx.Node) -> NoReturn:
    what = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    raise ComplexUnsupported(
        f"'{n.name}' ({what}) works on complex values, which ONNX has no type for, and graphgrow has no real-pair "
        "rewrite for it (it rewrites view_as_complex, view_as_real, polar, complex mul/add/sub, unsqueeze, "
        "reshape/view, indexing and slices, and casts)",
        "write the complex arithmetic in real pairs in the model, or skip the ONNX export (the grown model is saved)",
    )
