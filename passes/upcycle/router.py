"""upcycle's router: where it starts, and whether every expert will train.

The MLPs' inputs are read on the model's own example input (batch 4, eval mode), with which of their tokens the
output reads (a gradient probe: the last layer of a ViT feeds the classifier its class token only, so the other
tokens' expert choices teach nothing). The router's rows are random in the directions those inputs vary in,
whitened, off their mean direction; an expert that no read token chooses would get no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from graphgrow.passes.upcycle.mlps import Mlp  # noqa: TID251 (the upcycle package's own module)
from torch import fx
from torch.utils._pytree import tree_flatten

from graphgrow.rewrite import example_input, input_spec_of


@dataclass
class Seen:
    """An MLP's input on the example input, tokens × C, and which tokens the model's output reads."""

    tokens: torch.Tensor
    read: torch.Tensor  # bool, one per token


class _Probe(fx.Interpreter):
    """Runs the graph, keeping each MLP's output (a tensor its parameters make it require grad) to take the output's
    gradient on it."""

    def __init__(self, gm: fx.GraphModule, outs: set[fx.Node]):
        super().__init__(gm, garbage_collect_values=False)
        self.outs = outs
        self.leaves: dict[fx.Node, torch.Tensor] = {}

    def run_node(self, n: fx.Node):
        value = super().run_node(n)
        if n in self.outs and isinstance(value, torch.Tensor) and value.requires_grad:
            self.leaves[n] = value
        return value


def inputs_seen(gm: fx.GraphModule, mlps: list[Mlp]) -> dict[str, Seen]:
    """Each MLP's input and read tokens on the example input; {} on the meta device (a model sized before it runs:
    plain random router rows then, and no check of the experts)."""
    if any(p.is_meta for p in gm.parameters()):
        return {}
    modes = {m: m.training for m in gm.modules()}
    try:
        x = example_input(gm, input_spec_of(gm), seed=0, batch=4)
        probe = _Probe(gm.eval(), {m.output for m in mlps})
        with torch.enable_grad():
            out = probe.run(*(x.values() if isinstance(x, dict) else (x,)))
            flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            g = torch.Generator().manual_seed(0)
            loss = sum((t * torch.randn(t.shape, generator=g).to(t)).sum() for t in flat)
            leaves = list(probe.leaves.values())
            grads = torch.autograd.grad(loss, leaves, allow_unused=True) if flat and leaves else [None] * len(leaves)
        read = {
            n: (gr.flatten(0, -2).abs().sum(-1) > 0 if gr is not None else None) for n, gr in zip(probe.leaves, grads)
        }
        found = {}
        for m in mlps:
            tokens = probe.env[m.input].detach().flatten(0, -2).float().cpu()
            mask = read.get(m.output)
            found[m.input.name] = Seen(
                tokens, mask.cpu() if mask is not None else torch.zeros(len(tokens), dtype=torch.bool)
            )
        return found
    finally:
        for m, training in modes.items():
            m.training = training


def router_rows(seen: torch.Tensor | None, c: int, experts: int, std: float, g: torch.Generator) -> torch.Tensor:
    """E router rows of norm std·√C (the norm of N(0, std²) rows). Random in the directions the MLP's input varies in
    on the example input, each scaled by 1/its spread (whitened), off the inputs' mean direction: a direction that
    every token shares (a trained norm's output has some) would rank the experts alike for every token and leave some
    experts unchosen, untrained. Plain N(0, std²) rows without `seen`."""
    rows = torch.randn(experts, c, generator=g)
    if seen is not None and seen.shape[0] > 1:
        mean = seen.mean(0)
        _, spread, dirs = torch.linalg.svd(seen - mean, full_matrices=False)
        keep = spread > 1e-4 * spread[0].clamp_min(1e-30)
        if keep.any():
            scale = spread[keep] / (seen.shape[0] - 1) ** 0.5
            rows = torch.randn(experts, int(keep.sum()), generator=g) @ (dirs[keep] / scale[:, None])
            unit = mean / mean.norm().clamp_min(1e-30)
            rows = rows - (rows @ unit)[:, None] * unit
    return rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-30) * std * c**0.5


def idle_experts(seen: Seen, rows: torch.Tensor, top_k: int) -> tuple[list[int], str]:
    """The experts no token that the output reads chooses (they would not train), and those tokens in words."""
    tokens = seen.tokens[seen.read]
    chosen = set(torch.topk(tokens @ rows.T, top_k, dim=-1).indices.flatten().tolist()) if len(tokens) else set()
    words = f"{len(tokens)} of the example input's {len(seen.tokens)} tokens reach the output from here"
    return sorted(set(range(rows.shape[0])) - chosen), words
