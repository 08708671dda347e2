"""upcycle: a transformer's MLPs become mixtures of experts whose experts start as copies (sparse upcycling), exactly.

Each chosen MLP — Linear layers reading one tensor x, elementwise work between them (an activation, a SwiGLU
product, dropout), one Linear writing back to x's width: LLaMA's gate/up/down, GPT-2's c_fc/c_proj, an
nn.Sequential(Linear, GELU, Linear) — becomes E experts and a router:

    p = softmax(router(x))                     router: Linear(C → E, no bias)
    chosen = the top_k largest p (torch.topk: ties go the way torch.topk orders them)
    w_e = p_e / Σ_chosen p  for a chosen e, else 0        out = Σ_e w_e · expert_e(x)

Expert 0 is the original layers (their parameters keep their names, and an optimiser's state for them); experts
1..E-1 are exact copies. With identical experts, out = (Σ_e w_e) · mlp(x) = mlp(x) for every token, in eval and
train mode (to one rounding of the renormalisation): the function is unchanged. A tie in p changes nothing while the
experts are copies; after training a tie is a set of measure zero (onnxruntime's TopK puts the lower index first).

The graph computes the mixture in a dense form: every expert on every token, weighted by w (zero for the experts a
token did not choose). That is traceable, exports to ONNX (TopK, Equal, ReduceSum) and is exact, but costs E× the
MLP's FLOPs; a sparse runtime (a Mixtral-class model) runs only the top_k chosen experts per token.

How the experts diverge: the router starts small and random (N(0, router_std²)), so different tokens choose
different experts (top-k depends only on the logits' order, not their scale) and each copy gets the gradient of
only its own tokens, weighted by w: after the first step the copies differ. The router itself gets no gradient at
insertion — the chosen weights sum to one and the experts are equal, so moving it changes nothing — and learns from
the step after, once the experts differ (the check counts the experts' gradients at once and the router's from the
next SGD step). No noise is put on the copies: routing alone breaks the symmetry, and noise would cost exactness.

Refused: top_k > experts, experts < 2 and top_k < 2, at parse time (with one chosen expert its renormalised weight
is 1 for every token, whatever the router says, so the router would never get a gradient); no MLP found, or none at
`at=`; an MLP whose inner values are read outside it; an MLP already upcycled. Dropout inside an MLP draws its own
mask in every expert: exact in eval mode and in train mode with dropout off (as verified); with dropout on, a
token's output is another draw of the same mean (and the router gets a gradient at once, the copies' masks differing).
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import fx, nn

from graphgrow import Candidate, NotApplicable, Pass, Rewrite, arg
from graphgrow.rewrite import (
    ADDS_PARAMETERS,
    Requirement,
    add_module,
    begin,
    factory_kwargs,
    finish,
    graphgrow_modules,
    inserting_after,
    pass_function,
    place,
    replace_uses,
    set_scope,
    tensor_shape,
)

MIXTURES_KEY = "mixtures"  # graph metadata: MLP path → its router, top_k and each expert's layers (expert 0 first)
MAX_EXPERTS = 64  # one step; more is almost always a typo (each expert is a copy of the MLP)

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

    def params(self, gm: fx.GraphModule) -> int:
        own = sum(p.numel() for t in self.modules() for p in gm.get_submodule(t).parameters())
        return own + sum(
            gm.get_parameter(str(n.target)).numel() for n in self.nodes if n.op == "get_attr" and _is_param(gm, n)
        )


def _is_param(gm: fx.GraphModule, n: fx.Node) -> bool:
    try:
        gm.get_parameter(str(n.target))
    except AttributeError:
        return False
    return True


def _name(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")


def _linear(gm: fx.GraphModule, n: fx.Node) -> bool:
    """A Linear layer: an nn.Linear module, or F.linear on parameters."""
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


def _choose(mlps: list[Mlp], skipped: list[str], at: str | None) -> list[Mlp]:
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


def _local(mlp: Mlp, n: fx.Node) -> str:
    """A layer's (or parameter's) name inside an expert: its path below the MLP's, as one identifier."""
    prefix = mlp.path + "." if mlp.path != mlp.output.name else ""
    return str(n.target).removeprefix(prefix).replace(".", "_")


def _owned(gm: fx.GraphModule, n: fx.Node) -> bool:
    """A node whose layer or parameter each expert holds its own copy of."""
    return n.op == "call_module" or (n.op == "get_attr" and _is_param(gm, n))


def _copy_expert(gm: fx.GraphModule, mlp: Mlp, root: str, e: int, env: dict[fx.Node, fx.Node]) -> list[fx.Node]:
    """Expert e: the MLP's nodes again, on copies of its layers and parameters under `root`.expert{e}."""
    expert = nn.Module()
    gm.get_submodule(root).add_module(f"expert{e}", expert)
    made = []
    for n in mlp.nodes:
        new = gm.graph.node_copy(n, lambda a: env.get(a, a))
        if _owned(gm, n):
            local = _local(mlp, n)
            if n.op == "call_module":
                expert.add_module(local, copy.deepcopy(gm.get_submodule(str(n.target))))
            else:
                expert.register_parameter(local, nn.Parameter(gm.get_parameter(str(n.target)).detach().clone()))
            new.target = f"{root}.expert{e}.{local}"
        env[n] = new
        made.append(new)
    return made


def _upcycle_one(
    gm: fx.GraphModule, mlp: Mlp, experts: int, top_k: int, std: float, g: torch.Generator
) -> dict[str, object]:
    """Rewrite one MLP into the routed mixture; returns its record (MIXTURES_KEY)."""
    c = (tensor_shape(mlp.input) or (0,))[-1]
    kw = factory_kwargs(gm, mlp.input)
    router = nn.Linear(c, experts, bias=False, **kw)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * std)
    holder = nn.Module()
    holder.add_module("router", router)
    holder.register_buffer("expert_ids", torch.arange(experts, device=kw["device"]))
    root = add_module(gm, f"upcycle_{mlp.path}", holder)
    ids = f"{root}.expert_ids"
    graph = gm.graph
    made: list[fx.Node] = []

    def call(kind: str, target, *args, **kwargs) -> fx.Node:
        made.append(graph.get_attr(target) if kind == "get_attr" else getattr(graph, kind)(target, args, kwargs))
        return made[-1]

    outs = [mlp.output]
    with inserting_after(mlp.output):
        for e in range(1, experts):
            env: dict[fx.Node, fx.Node] = {mlp.input: mlp.input}
            made += _copy_expert(gm, mlp, root, e, env)
            outs.append(env[mlp.output])
        logits = call("call_module", f"{root}.router", mlp.input)
        probs = call("call_function", F.softmax, logits, dim=-1)
        top = call("call_function", torch.topk, probs, top_k, dim=-1)
        value, index = (call("call_function", operator.getitem, top, i) for i in (0, 1))
        share = call("call_function", operator.truediv, value, call("call_method", "sum", value, -1, keepdim=True))
        # which expert each of the K slots holds, one-hot over E (a comparison with the expert ids: no scatter, which
        # graphgrow's closed list of operations for reading files back does not hold)
        hot = call("call_function", operator.eq, call("call_method", "unsqueeze", index, -1), call("get_attr", ids))
        slot = call("call_function", operator.mul, hot, call("call_method", "unsqueeze", share, -1))
        weights = call("call_method", "sum", slot, -2)  # (..., E): w_e, zero for an expert not chosen
        stacked = call("call_function", torch.stack, outs, dim=-1)  # (..., C, E)
        mixed = call("call_function", operator.mul, stacked, call("call_method", "unsqueeze", weights, -2))
        out = call("call_method", "sum", mixed, -1)
    replace_uses(mlp.output, out, keep=made)
    set_scope(made, mlp.output)
    layers = {_local(mlp, n): str(n.target) for n in mlp.nodes if _owned(gm, n)}
    return {
        "mlp": mlp.path,
        "router": f"{root}.router",
        "top_k": top_k,
        "experts": [layers] + [{k: f"{root}.expert{e}.{k}" for k in layers} for e in range(1, experts)],
    }


@pass_function  # the arguments' defaults and allowed values: Upcycle's declaration
def upcycle(
    gm: fx.GraphModule,
    experts: int,
    top_k: int,
    at: str | None,
    router_std: float,
    generator: torch.Generator | None = None,
) -> Rewrite:
    """Turn every MLP (or the ones at `at`) into `experts` copies behind a top-`top_k` router, exactly."""
    gm, generator = begin(gm, generator)
    mlps, skipped = find_mlps(gm)
    if not mlps:
        raise NotApplicable(*_none_found(skipped))
    chosen = _choose(mlps, skipped, at)
    made = [_upcycle_one(gm, m, experts, top_k, router_std, generator) for m in chosen]
    roots = [str(r["router"]).rpartition(".")[0] for r in made]
    notes = [
        f"the graph runs all {experts} experts on every token (dense form: exact, traceable, ONNX-exportable; "
        f"{experts}× the MLPs' FLOPs); a sparse runtime runs {top_k} per token",
        "the router gets its first gradient one step after insertion (the chosen weights sum to one and the experts "
        "are equal); the experts learn at once, each from the tokens routed to it",
    ]
    if any(_dropout(gm, n) for m in chosen for n in m.nodes):
        notes.append(
            "dropout inside an MLP draws its own mask in every expert: exact in eval mode and in train mode with "
            "dropout off (as verified); with dropout on, each token's output is another draw of the same mean"
        )
    targets = {
        "mlps": ", ".join(f"{m.path} ({len(m.modules())} layers)" for m in chosen),
        "chosen": "given" if at is not None else "default: every MLP",
        "experts": f"{experts}: expert 0 the original layers, 1..{experts - 1} copies in {roots[0]}.expert*"
        + (f" (and {len(roots) - 1} more upcycle_* modules)" if len(roots) > 1 else ""),
        "routing": f"top-{top_k} of softmax(router(x)), chosen weights renormalised to sum to 1; "
        f"router Linear(C → {experts}, no bias) ~ N(0, {router_std:g}²)",
    }
    if skipped:
        targets["skipped"] = "; ".join(skipped)
    gm = finish(gm)
    info = gm.meta.setdefault("graphgrow", {})
    info[MIXTURES_KEY] = {**info.get(MIXTURES_KEY, {}), **{str(r["mlp"]): r for r in made}}
    return Rewrite(gm, targets, notes)


def _dropout(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        return isinstance(m, nn.Dropout) and m.p > 0
    return _name(n) == "dropout"


def _none_found(skipped: list[str]) -> tuple[str, str]:
    if skipped:
        return f"no MLP can be upcycled: {'; '.join(skipped)}", "upcycle the MLPs of another model"
    return (
        "no transformer MLP found (Linear layers reading one tensor, elementwise work, a Linear back to its width)",
        "upcycle grows MLPs written as Linear layers (nn.Linear or F.linear) with an activation between them",
    )


def _has_mlp(gm: fx.GraphModule) -> bool:
    """An MLP, or one that came close (the pass then says why it cannot upcycle it)."""
    return any(find_mlps(gm))


@dataclass(frozen=True)
class Upcycle(Pass):
    """Turn transformer MLPs into mixtures of experts (copies + a top-k router), exactly: sparse upcycling."""

    name: ClassVar[str] = "upcycle"
    function = upcycle
    requires = (
        Requirement(
            "a transformer MLP (Linear layers, an activation, a Linear back to the input width)",
            _has_mlp,
            "no transformer MLP found (Linear layers reading one tensor, elementwise work, a Linear back to its width)",
            "upcycle grows MLPs written as Linear layers (nn.Linear or F.linear) with an activation between them",
        ),
    )
    ensures = (ADDS_PARAMETERS,)
    experts: int = arg(
        4, "experts per MLP, E: expert 0 is the original, the others exact copies", low=2, high=MAX_EXPERTS
    )
    top_k: int = arg(
        2,
        "experts each token uses, 2 ≤ K ≤ E; their softmax weights are renormalised to sum to 1 (with K = 1 the "
        "weight would be 1 for every token and the router would never learn)",
        low=2,
    )
    at: str | None = arg(
        None, "module path of one MLP (e.g. model.layers.0.mlp) or of a module holding MLPs; default: every MLP"
    )
    router_std: float = arg(
        0.02, "the router's initial weights ~ N(0, router_std²): small, so routing starts near-uniform", above=0, high=1
    )

    def conflict(self) -> tuple[str, str, str] | None:
        if self.top_k > self.experts:
            return "top_k", f"top_k={self.top_k} is more than experts={self.experts}", "give top_k ≤ experts"
        return None

    def candidates(self, gm: fx.GraphModule) -> list[Candidate]:
        """Every MLP, each with the parameters its experts and router add; all are the default."""
        mlps, _ = find_mlps(gm)
        out = []
        for m in mlps:
            c = (tensor_shape(m.input) or (0,))[-1]
            added = (self.experts - 1) * m.params(gm) + c * self.experts
            out.append(Candidate({"at": m.path}, place(gm, m.output), added, True))
        return out
