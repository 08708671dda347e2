"""channel_scale: multiply a feature map by (1 + s) per channel, with s learnable and starting at 0.

Exact when inserted (s = 0), and s gets a gradient at once: the zero last factor of architecture.md §4.
Uses only graphgrow's public API: graphgrow (Pass, arg, NotApplicable, Candidate) and graphgrow.rewrite.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import ClassVar

import torch

from graphgrow import Candidate, NotApplicable, Pass, arg
from graphgrow.rewrite import (
    Rewrite,
    add_parameter,
    begin,
    channel_axis,
    default_point,
    factory_kwargs,
    finish,
    inserting_after,
    pass_function,
    place,
    replace_uses,
    resolve_tensor,
    set_scope,
    stage_end_candidates,
    tensor_shape,
)


def channels(node) -> int:  # the parameters channel_scale adds at `node`
    shape = tensor_shape(node)
    axis = channel_axis(shape) if shape else None
    return 0 if axis is None else shape[axis]


@pass_function  # `after` is declared once, by ChannelScale below: its default fills a call that leaves it out
def channel_scale(gm, after, generator=None) -> Rewrite:
    gm, generator = begin(gm, generator)  # a copy to edit, and the generator for new weights (none here)
    node, why = (resolve_tensor(gm, after, "out"), "given") if after else default_point(gm, channels)
    shape = tensor_shape(node)
    axis = channel_axis(shape) if shape else None
    if axis is None:
        raise NotApplicable(f"'{node.name}' has no channel dimension", "pick a feature map (N, C, …)")
    view = [1] * len(shape)
    view[axis] = shape[axis]
    s = add_parameter(gm, f"{node.name}_scale", torch.zeros(view, **factory_kwargs(gm, node)))
    with inserting_after(node):
        g = gm.graph.get_attr(s)
        one_plus = gm.graph.call_function(operator.add, (g, 1.0))
        scaled = gm.graph.call_function(operator.mul, (node, one_plus))
    replace_uses(node, scaled, keep=[scaled])
    set_scope([g, one_plus, scaled], node)
    return Rewrite(finish(gm), {"after": f"{node.name} {list(shape)}", "where": place(gm, node), "chosen": why})


@dataclass(frozen=True)
class ChannelScale(Pass):
    """Scale a feature map by (1 + s) per channel, s learnable from 0 (exact at insertion)."""

    name: ClassVar[str] = "channel_scale"
    function = channel_scale
    after: str | None = arg(None, "node name or module path (its output); default: the latest stage end")

    def candidates(self, gm) -> list[Candidate]:
        return stage_end_candidates(gm, channels)
