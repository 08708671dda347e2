"""A third-party pass package in miniature: registered only through the entry point below.

tests/plugin/gg_demo_plugin-0.1.dist-info/entry_points.txt declares
    [graphgrow.passes]
    scale_output = gg_demo_plugin:ScaleOutput
exactly as a package's pyproject would; putting tests/plugin on sys.path installs it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import ClassVar

import torch

import graphgrow as gg
from graphgrow.rewrite import Rewrite, add_parameter, copy_graph_module, finish, inserting_after, replace_uses


@dataclass(frozen=True)
class ScaleOutput(gg.Pass):
    """Multiply the model output by (1 + s) with a learnable s that starts at 0."""

    name: ClassVar[str] = "scale_output"
    note: str = "plugin"

    def apply(self, gm, generator):
        gm = copy_graph_module(gm)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        last = out.args[0]
        s = add_parameter(gm, "plugin_scale", torch.zeros(()))
        with inserting_after(last):
            g = gm.graph.get_attr(s)
            one = gm.graph.call_function(operator.add, (g, 1.0))
            scaled = gm.graph.call_function(operator.mul, (last, one))
        replace_uses(last, scaled, keep=[scaled])
        finish(gm)
        return Rewrite(gm, {"scaled": last.name}, [self.note])
