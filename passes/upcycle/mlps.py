"""upcycle's MLPs: where they are in the graph. An MLP is Linear layers reading one tensor x, elementwise work on each
token's features between them (activations, a product of two branches, dropout, a split of a fused projection
along the features), and one Linear writing back to x's width; found by walking back from each Linear through such
work to the Linears that read x. Anything else on the way (a view, a reduction, attention) means it is not one.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from graphgrow import NotApplicable
from graphgrow.rewrite import graphgrow_modules, tensor_shape

# ops an MLP may apply between its Linears: elementwise on each token's features (by fx name: op name of the target)
_ELEMENTWISE = frozenset(
    {
        "relu", "gelu", "silu", "tanh", "sigmoid", "erf", "exp", "pow", "softplus", "mish", "leaky_relu", "elu",
        "selu", "celu", "hardswish", "hardsigmoid", "relu6", "neg", "abs", "square", "sqrt",
        "add", "sub", "mul", "div", "truediv", "rsub",
        "dropout", "contiguous", "clone", "float", "to", "type_as",
    }
)  # fmt: skip
# what makes it an MLP rather than a low-rank pair of Linears: an activation, or a product of two branches (SwiGLU)
_LINEAR_WORK = frozenset({"neg", "add", "sub", "mul", "div", "truediv", "rsub", "dropout", "contiguous", "clone"})
_NONLINEAR = _ELEMENTWISE - _LINEAR_WORK - {"float", "to", "type_as"}
_SAFE_MODULES = (nn.Dropout, nn.Identity)
_NOT_ELEMENTWISE_ACTIVATIONS = (nn.MultiheadAttention, nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d, nn.GLU)


@dataclass
class Mlp:
    """One MLP in the graph: the tensor its Linears read, the writer's output, every node of it in graph order."""

    input: fx.Node
    output: fx.Node
    nodes: list[fx.Node]
    path: str  # the module holding its layers (their longest common path), or the writer's node name

    def modules(self) -> list[str]:
        return [str(n.target) for n in self.nodes if n.op == "call_module"]

    def linears(self, gm: fx.GraphModule) -> int:
        """How many Linear layers it has (modules or F.linear calls)."""
        return sum(_linear(gm, n) for n in self.nodes)

    def params(self, gm: fx.GraphModule) -> int:
        own = sum(p.numel() for t in self.modules() for p in gm.get_submodule(t).parameters())
        return own + sum(
            gm.get_parameter(str(n.target)).numel() for n in self.nodes if n.op == "get_attr" and is_param(gm, n)
        )


def is_param(gm: fx.GraphModule, n: fx.Node) -> bool:
    try:
        gm.get_parameter(str(n.target))
    except AttributeError:
        return False
    return True


def _name(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")


def _linear(gm: fx.GraphModule, n: fx.Node) -> bool:
    """A Linear layer: an nn.Linear module, or F.linear on parameters (its input given by position)."""
    if not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))) is nn.Linear
    return n.op == "call_function" and n.target is F.linear


def _elementwise(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Work that acts on each token's features alone (no view, no reduction, no mixing of tokens)."""
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        return isinstance(m, _SAFE_MODULES) or (
            type(m).__module__ == nn.modules.activation.__name__ and not isinstance(m, _NOT_ELEMENTWISE_ACTIVATIONS)
        )
    if n.op == "get_attr":
        return True
    if n.op in ("call_function", "call_method"):
        if n.target in (torch.chunk, torch.split) or n.target in ("chunk", "split"):  # a fused gate/up projection
            dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
            shape = tensor_shape(n.args[0]) if isinstance(n.args[0], fx.Node) else None
            return shape is not None and dim in (-1, len(shape) - 1)
        if n.target is operator.getitem:  # one piece of such a split
            src = n.args[0]
            return isinstance(src, fx.Node) and isinstance(n.args[1], int) and _name(src) in ("chunk", "split")
        return _name(n) in _ELEMENTWISE
    return False


def _region(gm: fx.GraphModule, writer: fx.Node) -> tuple[Mlp | None, str | None]:
    """The MLP `writer` ends, walking back from it through elementwise work to the Linears that read its input:
    (the MLP, None), or (None, why not) — None, None when the writer is not the end of an MLP at all."""
    if not _linear(gm, writer) or not writer.args or not isinstance(writer.args[0], fx.Node):
        return None, None
    region: dict[fx.Node, None] = {writer: None}
    readers: list[fx.Node] = []
    todo = [a for a in writer.all_input_nodes]
    while todo:
        n = todo.pop()
        if n in region:
            continue
        region[n] = None
        if _linear(gm, n):
            readers.append(n)
            todo += [a for a in n.all_input_nodes[1:]]  # F.linear's weight and bias
            continue
        if not _elementwise(gm, n):
            return None, None
        todo += list(n.all_input_nodes)
    inputs = {r.args[0] for r in readers}
    if not readers or len(inputs) != 1:
        return None, None
    x = next(iter(inputs))
    if not isinstance(x, fx.Node) or x in region:
        return None, None
    body = [n for n in region if n.op != "get_attr"]
    if not any(_nonlinear(gm, n) for n in body):
        return None, None  # a low-rank pair of Linears (an adapter), not an MLP
    x_shape, out_shape = tensor_shape(x), tensor_shape(writer)
    if x_shape is None or out_shape is None or x_shape[-1] != out_shape[-1]:
        return None, None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = sorted(region, key=order.__getitem__)
    path = _common_path([str(n.target) for n in nodes if n.op in ("call_module", "get_attr")]) or writer.name
    leak = next((n for n in body if n is not writer and any(u not in region for u in n.users)), None)
    if leak is not None:
        return None, f"the MLP at '{path}': its inner value '{leak.name}' is also read outside it"
    return Mlp(x, writer, nodes, path), None


def _nonlinear(gm: fx.GraphModule, n: fx.Node) -> bool:
    """An activation (function or module), or a product of two computed tensors (SwiGLU's act(gate) · up)."""
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))).__module__ == nn.modules.activation.__name__
    if _name(n) == "mul":
        return sum(isinstance(a, fx.Node) and a.op != "get_attr" for a in n.args) == 2
    return _name(n) in _NONLINEAR


def _common_path(paths: list[str]) -> str:
    """The longest common module path of the layers' own paths (a layer's parent when it is alone)."""
    parts = [p.split(".")[:-1] for p in paths]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def find_mlps(gm: fx.GraphModule) -> tuple[list[Mlp], list[str]]:
    """Every MLP of the graph in graph order (not those upcycle made: a copy or an expert 0 already routed),
    and why near-misses were left out."""
    added = {m for m in graphgrow_modules(gm) if m.startswith("upcycle")}
    routed = {
        n.args[0] for n in gm.graph.nodes if n.op == "call_module" and str(n.target).split(".")[0] in added and n.args
    }
    found, skipped = [], []
    for n in gm.graph.nodes:
        mlp, why = _region(gm, n)
        if why is not None:
            skipped.append(why)
        if mlp is None:
            continue
        if mlp.input in routed:  # an expert 0 already behind a router, or one of its copies
            why = f"the MLP at '{mlp.path}' is already a mixture of experts"
            skipped += [] if why in skipped or mlp.path.split(".")[0] in added else [why]
            continue
        found.append(mlp)
    return found, skipped


def choose_mlps(mlps: list[Mlp], skipped: list[str], at: str | None) -> list[Mlp]:
    if at is None:
        return mlps
    chosen = [
        m
        for m in mlps
        if m.path == at
        or m.path.startswith(at + ".")
        or any(n.name == at or str(n.target) == at for n in m.nodes if n.op != "get_attr")
    ]
    if not chosen:
        raise NotApplicable(
            f"no MLP at '{at}'" + "".join(f"; {why}" for why in skipped if f"'{at}" in why),
            f"name one of: {', '.join(m.path for m in mlps)} (graphgrow targets MODEL --pass upcycle lists them)",
        )
    return chosen


# --- the rewrite -----------------------------------------------------------------------------------------------


def _has_dropout(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        return isinstance(m, nn.Dropout) and m.p > 0
    return _name(n) == "dropout"


def has_dropout(gm: fx.GraphModule, mlp: Mlp) -> bool:
    """Dropout with p > 0 inside the MLP (each expert would draw its own mask)."""
    return any(_has_dropout(gm, n) for n in mlp.nodes)
