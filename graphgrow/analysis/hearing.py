"""Which tensors the model's output hears: a gradient from the output reaches them, and not a vanishing one.

A layer grown where no gradient arrives can never learn, so verification refuses it (verify.deaf_points). A default
place must not be such a tensor: an untrained deep stack can pass its signal on at 1e-28 of its size (Hugging Face's
EfficientNet at its default width, every block's squeeze-excitation halving it), so that every place inside it is
deaf while the layers after the stack still learn. One forward and backward at the example input, in eval mode and
then, for what eval mode did not hear, train mode (dropout off, buffers restored), as verification checks them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import fx

from ..core.protocol import BATCHES, flat_tensors
from ..core.state import dropout_off, preserved_buffers, training_mode
from ..graph.graph_meta import input_spec_of
from ..graph.inputs import positional
from ..graph.shapes import example_input

T = TypeVar("T")


def heard(grad: torch.Tensor) -> bool:
    """A gradient reaches a tensor when it is not vanishing: some entry at least float32's eps² of the output's
    (the random projection's entries are about 1). An untrained 55-block EfficientNet passes 1e-28 to its middle:
    every update there is lost to rounding, and a layer grown there gets exactly none."""
    return bool((grad.abs() >= torch.finfo(torch.float32).eps ** 2).any())


def heard_nodes(gm: fx.GraphModule, nodes: Iterable[fx.Node], fed: set[str] | None = None) -> set[str]:
    """The names of `nodes` (float tensors of `gm`) that a random projection of the output sends a gradient that
    `heard`, at the example input (seeded) at verification's first batch, in eval or train mode. The model is left
    as it was. `fed`, when given, gets the names of those whose first input is not zero everywhere in a mode run: a
    layer fed only zeros (a LayerNorm over one channel gives its β; a dead ReLU) gives its new units no gradient."""
    nodes = list(nodes)
    wanted = {n.name for n in nodes}
    inputs = {n.name: n.args[0].name for n in nodes if n.args and isinstance(n.args[0], fx.Node)}
    found: set[str] = set()
    x = example_input(gm, input_spec_of(gm), batch=BATCHES[0])  # verification's batch (train-mode BatchNorm needs 2)
    g = torch.Generator().manual_seed(1)
    for train in (False, True):
        keep = _Keep(gm, wanted - found, set(inputs.values()))
        with training_mode(gm, train), dropout_off(gm), preserved_buffers(gm), torch.enable_grad():
            outs = [t for t in flat_tensors(keep.run(*positional(x))) if t.is_floating_point() and t.requires_grad]
            if outs and keep.kept:  # autograd.grad, not backward: the parameters' .grad stay as they were
                loss = sum((t * torch.randn(t.shape, generator=g).to(t)).sum() for t in outs)
                grads = torch.autograd.grad(loss, list(keep.kept.values()), allow_unused=True)
                found |= {k for k, gr in zip(keep.kept, grads) if gr is not None and heard(gr)}
        if fed is not None:
            fed |= {k for k, a in inputs.items() if a in keep.nonzero}
        if found >= wanted:
            break
    return found


class _Keep(fx.Interpreter):
    """Runs the graph and keeps the outputs of the nodes named `wanted` that carry a gradient."""

    def __init__(self, gm: fx.GraphModule, wanted: set[str], inputs: frozenset[str] | set[str] = frozenset()):
        super().__init__(gm)
        self.wanted, self.inputs = wanted, inputs
        self.kept: dict[str, torch.Tensor] = {}
        self.nonzero: set[str] = set()  # the `inputs` that are not zero everywhere

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.name in self.inputs and isinstance(out, torch.Tensor) and bool(out.detach().any()):
            self.nonzero.add(n.name)
        if n.name in self.wanted and isinstance(out, torch.Tensor) and out.requires_grad:
            self.kept[n.name] = out
        return out


def keep_heard(gm: fx.GraphModule, places: list[T], node: Callable[[T], fx.Node], fed: bool = False) -> list[T]:
    """The `places` (in order) whose `node` the output hears, for a pass's default: all of them when it hears none
    (verification then says why) or the model cannot be run here (a meta-device plan, a model that fails). `fed`:
    also those whose node's input is not zero everywhere (heard_nodes' `fed`), for a layer that grows new units."""
    if not places or any(p.is_meta for p in gm.parameters()):
        return places
    try:
        given: set[str] = set()
        live = heard_nodes(gm, [node(p) for p in places], given)
        live &= given if fed else live
    except Exception:  # a probe, not a check: a model that cannot run here is refused where it is run
        return places
    return [p for p in places if node(p).name in live] or places
