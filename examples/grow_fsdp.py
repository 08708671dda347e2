"""Growth in a sharded job: a small decoder trained with FSDP2 (torch.distributed.fsdp.fully_shard, one unit per
layer) and AdamW on several processes, grown at set steps with gg.distributed.grow — each rank keeps only its shards
of the grown parameters and of AdamW's moments.

    torchrun --standalone --nproc_per_node=2 examples/grow_fsdp.py --steps 30

gloo on the CPU, NCCL when every rank has a GPU. The task: predict the next token of sequences that count up modulo
the vocabulary from a random start (learnable by a tiny model in a few dozen steps).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import graphgrow as gg

VOCAB, CONTEXT, GLOBAL_BATCH = 96, 16, 16
EVENTS = {10: "grow_hidden(by=16)", 20: "grow_heads(by=2)"}  # step → pass spec


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim, eps=1e-6)
        self.self_attn = Attention(dim, heads)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Pre-norm decoder: embedding, `layers` × (RMSNorm, causal attention, RMSNorm, MLP), RMSNorm, LM head."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Layer(dim, heads) for _ in range(layers)])
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def traced(dim: int = 32, layers: int = 2, seed: int = 0):
    """The decoder traced by graphgrow (the same weights on every rank: the same seed)."""
    torch.manual_seed(seed)
    return gg.trace(Decoder(dim=dim, layers=layers).train(), input_shape={"input_ids": ((2, CONTEXT), torch.int64)})


def batch(step: int, rank: int = 0, world: int = 1, size: int = GLOBAL_BATCH):
    """This rank's share of the global batch of `step`: sequences start + 0, 1, 2 … mod VOCAB; targets shifted."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    seq = (start + torch.arange(CONTEXT + 1)) % VOCAB
    per = size // world
    mine = seq[rank * per : (rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def loss_of(model: nn.Module, x, y) -> torch.Tensor:
    out = model(x)  # FSDP's root moves the input to the model's device
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.to(out.device).reshape(-1))


def train_step(model, opt, step: int, rank: int, world: int) -> float:
    x, y = batch(step, rank, world)
    opt.zero_grad()
    loss = loss_of(model, x, y)
    loss.backward()  # FSDP2 reduce-scatters the gradients: each rank keeps its shard
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / world


def probe(model: nn.Module) -> float:
    """The loss on a fixed batch in eval mode (every rank computes it on the same batch)."""
    model.eval()
    with torch.no_grad():
        loss = loss_of(model, *batch(10_000)).item()
    model.train()
    return loss


def run(steps: int, say=print) -> dict:
    """Train for `steps` steps in the process group that is running, growing at EVENTS; returns the losses and, per
    event, the loss on a fixed batch just before and just after it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world,))
    model = gg.distributed.shard(traced().to(device), layers=["layers.0", "layers.1"], mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, events = {}, {}
    for step in range(steps):
        if step in EVENTS:
            before = probe(model)
            g = gg.distributed.grow(model, opt, EVENTS[step], seed=step, timeout=120)
            model, opt = g.model, g.optimizer
            after = probe(model)
            events[step] = {"before": before, "after": after, "seconds": g.seconds}
            say(
                f"step {step}: {EVENTS[step]} on {world} rank(s) in {g.seconds['total']:.2f} s "
                f"(gather {g.seconds['gather']:.3f}, grow {g.seconds['grow']:.3f}, reshard {g.seconds['reshard']:.3f}, "
                f"carry {g.seconds['carry']:.3f}); {sum(p.numel() for p in model.parameters()):,} parameters; "
                f"loss {before:.6f} → {after:.6f}"
            )
        start = time.perf_counter()
        losses[step] = train_step(model, opt, step, rank, world)
        if step % 5 == 4 or step == steps - 1:
            say(f"step {step}: loss {losses[step]:.4f} ({(time.perf_counter() - start) * 1000:.0f} ms)")
    return {"losses": losses, "events": events}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # FSDP2's note on grouped leaves' outputs
    run(args.steps, say=print if dist.get_rank() == 0 else (lambda *a, **k: None))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
