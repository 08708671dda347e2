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

How the experts diverge: routing. The router starts small (rows of norm router_std·√C, as N(0, router_std²) rows
have) and random — in the directions the MLP's input varies in on the model's example input, whitened, off the
inputs' mean direction (plain N(0, router_std²) where the model cannot run, on the meta device): a direction every
token shares, as a trained norm's output has, would rank the experts alike for every token and leave some unchosen.
An MLP where the tokens the output reads (router.py's gradient probe) leave an expert unchosen is left dense by
default (said in `skipped`) and refused when named: that expert would not train.
Top-k depends on the logits' order, not their scale, so different tokens choose different experts from the start,
and each copy gets the gradient of its own tokens only, weighted by w: after the first step the copies differ. The
router's gradient at insertion is zero but for rounding — the chosen weights sum to one and the experts are equal,
so moving it changes nothing (verification's trainability check may count that rounding as a step-0 gradient) — and
it learns from the step after, once the experts differ. No noise is put on the copies: routing alone breaks the
symmetry, and noise would cost exactness. The graph records each mixture (`mixtures`: the router, top_k and every
expert's layers), which as_native reads to hand back the family's MoE class (jobs/native_moe.py).

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
from graphgrow.passes.upcycle.mlps import (  # noqa: TID251 (the upcycle package's own module)
    Mlp,
    choose_mlps,
    find_mlps,
    has_dropout,
    is_param,
)
from graphgrow.passes.upcycle.router import idle_experts, inputs_seen, router_rows  # noqa: TID251
from torch import fx, nn

from graphgrow import Candidate, NotApplicable, Pass, Rewrite, arg
from graphgrow.rewrite import (
    ADDS_PARAMETERS,
    Requirement,
    add_module,
    begin,
    factory_kwargs,
    finish,
    inserting_after,
    pass_function,
    place,
    replace_uses,
    set_scope,
    tensor_shape,
)

MIXTURES_KEY = "mixtures"  # graph metadata: MLP path → its router, top_k and each expert's layers (expert 0 first)
MAX_EXPERTS = 64  # one step; more is almost always a typo (each expert is a copy of the MLP)


def _local(mlp: Mlp, n: fx.Node) -> str:
    """A layer's (or parameter's) name inside an expert: its path below the MLP's, as one identifier."""
    prefix = mlp.path + "." if mlp.path != mlp.output.name else ""
    return str(n.target).removeprefix(prefix).replace(".", "_")


def _owned(gm: fx.GraphModule, n: fx.Node) -> bool:
    """A node whose layer or parameter each expert holds its own copy of."""
    return n.op == "call_module" or (n.op == "get_attr" and is_param(gm, n))


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


def _upcycle_one(gm: fx.GraphModule, mlp: Mlp, experts: int, top_k: int, rows: torch.Tensor) -> dict[str, object]:
    """Rewrite one MLP into the routed mixture; returns its record (MIXTURES_KEY)."""
    c = (tensor_shape(mlp.input) or (0,))[-1]
    kw = factory_kwargs(gm, mlp.input)
    router = nn.Linear(c, experts, bias=False, **kw)
    with torch.no_grad():
        router.weight.copy_(rows)
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
    chosen = choose_mlps(mlps, skipped, at)
    seen = inputs_seen(gm, chosen)
    made, kept = [], []
    for m in chosen:
        c, probe = (tensor_shape(m.input) or (0,))[-1], seen.get(m.input.name)
        rows = router_rows(probe.tokens if probe else None, c, experts, router_std, generator)
        idle, words = idle_experts(probe, rows, top_k) if probe else ([], "")
        if idle:  # given: refused; by default: left dense, said in the report
            why = (
                f"at '{m.path}', no token that the output reads chooses expert(s) {', '.join(map(str, idle[:8]))} "
                f"of {experts} ({words}): they would not train"
            )
            if at is not None:
                raise NotApplicable(why, "give fewer experts or a larger top_k, or a longer example input")
            skipped.append(why)
            continue
        made.append(_upcycle_one(gm, m, experts, top_k, rows))
        kept.append(m)
    if not made:
        raise NotApplicable(*_none_found(skipped))
    roots = [str(r["router"]).rpartition(".")[0] for r in made]
    notes = [
        f"the graph runs all {experts} experts on every token (dense form: exact, traceable, ONNX-exportable; "
        f"{experts}× the MLPs' FLOPs); a sparse runtime runs {top_k} per token",
        "the router's gradient is zero at insertion but for rounding (the chosen weights sum to one and the experts "
        "are equal): it learns from the next step, once the experts, each trained by the tokens routed to it, differ",
    ]
    if any(has_dropout(gm, m) for m in kept):
        notes.append(
            "dropout inside an MLP draws its own mask in every expert: exact in eval mode and in train mode with "
            "dropout off (as verified); with dropout on, each token's output is another draw of the same mean"
        )
    targets = {
        "mlps": ", ".join(f"{m.path} ({m.linears(gm)} Linear layers)" for m in kept),
        "chosen": "given" if at is not None else "default: every MLP whose experts all train",
        "experts": f"{experts}: expert 0 the original layers, 1..{experts - 1} copies in {roots[0]}.expert*"
        + (f" (and {len(roots) - 1} more upcycle_* modules)" if len(roots) > 1 else ""),
        "routing": f"top-{top_k} of softmax(router(x)), chosen weights renormalised to sum to 1; "
        f"router Linear(C → {experts}, no bias), rows of norm {router_std:g}·√C",
    }
    if skipped:
        targets["skipped"] = "; ".join(skipped)
    gm = finish(gm)
    info = gm.meta.setdefault("graphgrow", {})
    info[MIXTURES_KEY] = {**info.get(MIXTURES_KEY, {}), **{str(r["mlp"]): r for r in made}}
    return Rewrite(gm, targets, notes)


NO_MLP = "no transformer MLP found (Linear layers reading one tensor, elementwise work, a Linear back to its width)"
NO_MLP_HINT = "upcycle grows MLPs written as Linear layers (nn.Linear or F.linear) with an activation between them"


def _none_found(skipped: list[str]) -> tuple[str, str]:
    if skipped:
        return (
            f"no MLP can be upcycled: {'; '.join(skipped)}",
            "give fewer experts or a larger top_k, or trace the model with a larger example input",
        )
    return NO_MLP, NO_MLP_HINT


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
            NO_MLP,
            NO_MLP_HINT,
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
        0.02,
        "the router's rows start with the norm of N(0, router_std²) rows (random, whitened on the example input): "
        "small, so the chosen weights start near-uniform",
        above=0,
        high=1,
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
