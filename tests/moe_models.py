"""Mixture-of-experts layers written the ways published code writes them, tiny (hidden 16, 4 experts, top 2), in a
pre-norm block: experts stacked in one parameter and gathered by the routed indices, multiplied with `torch.bmm`
([E, out, in], as transformers' batched_mm experts: Mixtral, Qwen-MoE, …) or with `@` ([E, in, out] gathered with
index_select, the transposed layout of Aria and GPT-OSS); every expert on every token with an einsum, weighted by the
dense routing probabilities; and a ModuleList of Linear experts. For grow_hidden (the stream reaches the experts'
inputs and outputs) and grow_width (the experts' intermediate width)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

H, I, E, K, VOCAB = 16, 8, 4, 2, 40


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        top, ids = torch.topk(probs, K, dim=-1)
        return probs, top / top.sum(dim=-1, keepdim=True), ids


class GatheredBmm(nn.Module):
    """gate_up [E, 2I, H], down [E, H, I]; the tokens repeated once per chosen expert."""

    def __init__(self):
        super().__init__()
        self.router = Router()
        self.gate_up = nn.Parameter(torch.randn(E, 2 * I, H) / H**0.5)
        self.down = nn.Parameter(torch.randn(E, H, I) / I**0.5)

    def forward(self, x):
        _, weights, ids = self.router(x)
        ids = ids.reshape(-1)
        h = torch.bmm(self.gate_up[ids], x.repeat_interleave(K, dim=0).unsqueeze(-1)).squeeze(-1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(self.down[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (y * weights.reshape(-1, 1)).view(-1, K, H).sum(dim=1)


class InOutExperts(nn.Module):
    """Experts stacked in the transposed layout: w_in [E, H, I], w_out [E, I, H]."""

    def __init__(self):
        super().__init__()
        self.router = Router()
        self.w_in = nn.Parameter(torch.randn(E, H, I) / H**0.5)
        self.w_out = nn.Parameter(torch.randn(E, I, H) / I**0.5)


class TransposedMatmul(InOutExperts):
    """Gathered with index_select and multiplied from the right with `@`."""

    def forward(self, x):
        _, weights, ids = self.router(x)
        ids = ids.reshape(-1)
        xs = x.repeat_interleave(K, dim=0).unsqueeze(1)
        h = F.gelu(xs @ torch.index_select(self.w_in, 0, ids))
        y = (h @ self.w_out.index_select(0, ids)).squeeze(1)
        return (y * weights.reshape(-1, 1)).view(-1, K, H).sum(dim=1)


class DenseEinsum(InOutExperts):
    """Every expert on every token, mixed by the routing probabilities."""

    def forward(self, x):
        probs, _, _ = self.router(x)
        xe = x.unsqueeze(0).expand(E, -1, -1)
        h = F.silu(torch.einsum("enh,ehi->eni", xe, self.w_in))
        y = torch.einsum("eni,eih->enh", h, self.w_out)
        return (y * probs.t().unsqueeze(-1)).sum(dim=0)


class ModuleListExperts(nn.Module):
    """Experts as Linear modules, each on every token, weighted by its routing probability."""

    def __init__(self):
        super().__init__()
        self.router = Router()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(H, I), nn.GELU(), nn.Linear(I, H)) for _ in range(E))

    def forward(self, x):
        probs, _, _ = self.router(x)
        out = self.experts[0](x) * probs[:, 0:1]
        for e in range(1, E):
            out = out + self.experts[e](x) * probs[:, e : e + 1]
        return out


MOES: dict[str, type[nn.Module]] = {
    "gathered_bmm": GatheredBmm,
    "transposed_matmul": TransposedMatmul,
    "dense_einsum": DenseEinsum,
    "module_list": ModuleListExperts,
}


class MoEBlock(nn.Module):
    """Embedding → x + moe(RMSNorm(x)) over the flattened tokens → RMSNorm → LM head."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.moe = nn.Embedding(VOCAB, H), MOES[kind]()
        self.norm1, self.norm2, self.head = nn.RMSNorm(H), nn.RMSNorm(H), nn.Linear(H, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.moe(self.norm1(x).reshape(-1, H)).view(x.shape)
        return self.head(self.norm2(x))


SPEC = "ids:2x5:int64"
