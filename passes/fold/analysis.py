"""The merge analysis: the form of every node, composed along chains and summed across adds, kept where
one layer costs no more multiply-adds and weights than its parts, and, for an add that stays, why."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from graphgrow.passes.fold.algebra import compose, is_sum, sum_forms  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.form import Form, identity_form, kind_of, numel  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.graph import SUB  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.local import local_form  # noqa: TID251 (the fold package's own module)
from torch import fx

from graphgrow.rewrite import tensor_shape


@dataclass
class Analysis:
    forms: dict  # node → the form worth emitting
    why: dict  # add/sub node → why its operands stayed apart


def analyse(gm: fx.GraphModule, grow_kernels: bool = False) -> Analysis:
    """Forms of every node. `forms` holds those worth emitting (no more multiply-adds than the parts);
    `full` composes regardless of cost, because a costly chain can still disappear into a sum
    (an average-pool branch with a 1×1 adapter merges into a 3×3 main conv for free)."""
    forms: dict[fx.Node, Form] = {}
    full: dict[fx.Node, Form] = {}
    why: dict[fx.Node, str] = {}

    def absorbable(p: fx.Node, n: fx.Node) -> bool:
        return p in full and set(p.users) == {n}

    def combine(new: Form | None, parts: list[Form], own_macs: int, own: set) -> Form | None:
        if new is not None:
            new.macs = sum(p.macs for p in parts) + own_macs
            new.params = sum(p.params for p in parts)
            new.nodes = set().union(*(p.nodes for p in parts)) | own
            new.weighted = [w for p in parts for w in p.weighted]
        return new

    def cheap(f: Form | None, shape) -> bool:
        # no more multiply-adds, and no more weights (a 2×2 average pool after a 1×1 conv is a 2×2 conv:
        # the same multiply-adds, four times the weights)
        return f is not None and f.cost(shape) <= f.macs and f.size() <= max(f.params, 2 * f.out_channels)

    def options(x: fx.Node, n: fx.Node, kind: str) -> list[Form]:
        got = [f for f in (forms.get(x), full.get(x)) if f is not None] if absorbable(x, n) else []
        eye = identity_form(kind, x)
        return list({id(f): f for f in got}.values()) + ([eye] if eye is not None else [])

    for n in gm.graph.nodes:
        shape = tensor_shape(n)
        if shape is None:
            continue
        if is_sum(n):
            kind = kind_of(n)
            if kind is None:
                continue
            a, b = n.args
            sign = -1.0 if n.target in SUB else 1.0
            for fa in options(a, n, kind):
                for fb in options(b, n, kind):
                    if fa.src is not fb.src:
                        continue
                    got = combine(sum_forms(fa, fb, sign, shape), [fa, fb], numel(shape), {n})
                    if got is None:
                        continue
                    if kind == "conv" and not grow_kernels and _grows_kernel(fa, got):
                        why[n] = (
                            f"merging would grow the kernel of '{a.name}' from {_k(fa)} to {_k(got)} "
                            "(fold(grow_kernels=true) does it: fewer multiply-adds than unfolded, "
                            "more than before growth)"
                        )
                        continue
                    full.setdefault(n, got)
                    if cheap(got, shape):
                        forms[n] = got
                        break
                    why[n] = "merging its terms into one layer would cost more multiply-adds than it saves"
                if n in forms:
                    break
            if n not in full and n not in why:
                why[n] = _apart(gm, full, a, b, n)
            continue
        local = local_form(gm, n)
        if local is None:
            continue
        local.nodes = {n}
        p = local.src
        forms[n] = full[n] = local
        if absorbable(p, n):
            own = dataclasses.replace(local)
            whole = combine(compose(local, full[p]), [full[p], own], 0, set())
            if whole is not None:
                full[n] = whole
            inner = forms.get(p)
            got = (
                whole
                if inner is full[p]
                else (combine(compose(local, inner), [inner, own], 0, set()) if inner else None)
            )
            if cheap(got, shape):
                forms[n] = got  # type: ignore[assignment]
    return Analysis(forms, why)


def _k(f: Form) -> str:
    return f"{f.weight.shape[2]}×{f.weight.shape[3]}"


def _grows_kernel(main: Form, merged: Form) -> bool:
    """The merged kernel is larger than the first term's (the main path's) in some direction."""
    return merged.weight.shape[2] > main.weight.shape[2] or merged.weight.shape[3] > main.weight.shape[3]


def _apart(gm: fx.GraphModule, full: dict, a: fx.Node, b: fx.Node, n: fx.Node) -> str:
    def what(x: fx.Node) -> str:
        src = full[x].src if x in full and set(x.users) == {n} else x
        if src.op not in ("call_module", "call_function", "call_method"):
            return f"'{src.name}'"
        linear = local_form(gm, src) is not None or is_sum(src)
        return f"'{src.name}' ({_describe(src)}{'' if linear else ': not linear'})"

    return f"its terms read different tensors: {what(a)} and {what(b)}"


def _describe(n: fx.Node) -> str:
    if n.op == "call_module":
        return f"{type(n.graph.owning_module.get_submodule(n.target)).__name__} '{n.target}'"
    return getattr(n.target, "__name__", str(n.target))
