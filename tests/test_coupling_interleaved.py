"""Gate and up projections interleaved in one output (`h[..., ::2]`, `h[..., 1::2]`), and a per-expert bias gathered
by the routed indices (`bias[ids]`): the coupling analysis follows both (issue 39: hf gpt_oss grow_width was refused,
'every channel group of this model is frozen': its experts' gate_up output [E, H, 2I] holds gate and up channels
alternately, taken apart with strided slices and fed to a clamped SwiGLU, and its bias [E, 2I] is read as
`gate_up_proj_bias[ids]`; both froze the experts' intermediate group).

The strided pieces of one tensor that together take every channel (`x[..., o::s]` for o < s) are the channels of
one group, `s` interleaved per channel of the pieces: a growth of the pieces by k puts k·s channels at the end of the
whole, every piece gaining its k. A gather along another axis than the channels (`p[ids]`, `index_select`) keeps each
channel: a per-expert bias grows along its channel axis with its group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.analysis.coupling import analyze

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("one_thread")]  # conftest.py

H, I, E, K = 8, 6, 4, 2


def halves(h: torch.Tensor, spelling: str) -> tuple[torch.Tensor, torch.Tensor]:
    if spelling == "[..., ::2]":  # GPT-OSS
        return h[..., ::2], h[..., 1::2]
    if spelling == "stop at the size":  # read at run time, it would be held at the old size: not followed
        return h[:, 0 : h.shape[-1] : 2], h[:, 1 : h.shape[-1] : 2]
    return h[:, 0::2], h[:, 1::2]  # "[:, 0::2]"


def swiglu(gate, up, spelling):
    if spelling == "clamped":  # GPT-OSS: gate clamped above, up on both sides, a sigmoid gate
        gate, up = gate.clamp(max=7.0), up.clamp(min=-7.0, max=7.0)
        return (up + 1) * (gate * torch.sigmoid(gate * 1.702))
    return F.silu(gate) * up


class InterleavedMLP(nn.Module):
    """A dense gated MLP whose fc1 output holds gate and up alternately."""

    def __init__(self, spelling: str):
        super().__init__()
        self.fc1, self.fc2, self.head, self.spelling = nn.Linear(H, 2 * I), nn.Linear(I, H), nn.Linear(H, 3), spelling

    def forward(self, x):
        gate, up = halves(self.fc1(x), self.spelling)
        return self.head(x + self.fc2(swiglu(gate, up, "silu")))


class InterleavedExperts(nn.Module):
    """GPT-OSS's experts: gate_up [E, H, 2I] and its bias [E, 2I] gathered by the routed ids (getitem or
    index_select), a clamped SwiGLU on the interleaved halves, down [E, I, H] with a gathered bias."""

    def __init__(self, gather: str, act: str = "clamped"):
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(H, E)
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * I) / H**0.5)
        self.gate_up_bias = nn.Parameter(torch.randn(E, 2 * I))
        self.down = nn.Parameter(torch.randn(E, I, H) / I**0.5)
        self.down_bias = nn.Parameter(torch.randn(E, H))
        self.head, self.gather, self.act = nn.Linear(H, 3), gather, act

    def pick(self, p, ids):
        return p[ids] if self.gather == "getitem" else torch.index_select(p, 0, ids)

    def forward(self, x):  # x: (tokens, H)
        top, ids = torch.topk(self.router(x), K, dim=-1)
        weights, ids = F.softmax(top, dim=-1).reshape(-1, 1), ids.reshape(-1)
        xs = x.repeat_interleave(K, dim=0).unsqueeze(1)
        h = torch.bmm(xs, self.pick(self.gate_up, ids)).squeeze(1) + self.pick(self.gate_up_bias, ids)
        mid = swiglu(h[..., ::2], h[..., 1::2], self.act)
        y = torch.bmm(mid.unsqueeze(1), self.pick(self.down, ids)).squeeze(1) + self.pick(self.down_bias, ids)
        return self.head(x + (y * weights).view(-1, K, H).sum(dim=1))


def grow(gm, target: str | None = None):
    r = gg.get_pass("grow_width")(**({"target": target} if target else {}))(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok, r.preservation
    return r


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("spelling", ["[..., ::2]", "[:, 0::2]"])
def test_interleaved_halves_grow_together(spelling, capture):
    torch.manual_seed(0)
    gm = gg.trace(InterleavedMLP(spelling), input_shape=(5, H), capture=capture)
    c = analyze(gm)
    fc1 = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "fc1")
    assert not c.why_frozen(c.group_of[fc1]), c.why_frozen(c.group_of[fc1])
    r = grow(gm, "fc1")
    fc1_new, fc2_new = r.gm.get_submodule("fc1"), r.gm.get_submodule("fc2")
    assert fc1_new.out_features > 2 * I and fc2_new.in_features == fc1_new.out_features // 2
    old = gm.get_submodule("fc1").weight  # old rows keep their places: gate c at 2c, up c at 2c + 1
    assert torch.equal(fc1_new.weight[: 2 * I], old)


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("gather,act", [("getitem", "clamped"), ("index_select", "clamped"), ("getitem", "silu")])
def test_interleaved_experts_with_gathered_biases_grow(gather, act, capture):
    gm = gg.trace(InterleavedExperts(gather, act), input_shape=(5, H), capture=capture)
    r = grow(gm)
    p = dict(r.gm.named_parameters())
    inner = p["gate_up"].shape[2]
    assert inner > 2 * I and p["gate_up_bias"].shape == (E, inner) and p["down"].shape == (E, inner // 2, H)
    before = dict(gm.named_parameters())
    assert torch.equal(p["gate_up"][:, :, : 2 * I], before["gate_up"])
    assert torch.equal(p["gate_up_bias"][:, : 2 * I], before["gate_up_bias"])
    assert torch.equal(p["router.weight"], before["router.weight"]) and p["down_bias"].shape == (E, H)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_stop_read_at_run_time_is_refused_not_broken(capture):
    gm = gg.trace(InterleavedMLP("stop at the size"), input_shape=(5, H), capture=capture)
    with pytest.raises(gg.NotApplicable):
        grow(gm, "fc1")


def test_one_strided_piece_alone_is_not_followed():
    """Only the even channels taken: the odd ones are read by nothing the growth could place, so no interleave."""

    class EvenOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(H, 2 * I), nn.Linear(I, H)

        def forward(self, x):
            return self.fc2(F.relu(self.fc1(x)[..., ::2]))

    gm = gg.trace(EvenOnly(), input_shape=(5, H), capture="fx")
    c = analyze(gm)
    fc1 = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "fc1")
    assert c.why_frozen(c.group_of[fc1])


def test_a_gather_along_the_channel_axis_still_freezes():
    """`x[:, ids]` picks channels by a computed index: a growth could not say where new ones go."""

    class PickChannels(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(H, 2 * I), nn.Linear(I, H)

        def forward(self, x):
            ids = torch.argsort(self.fc1.bias)[:I]
            return self.fc2(F.relu(self.fc1(x)[:, ids]))

    gm = gg.trace(PickChannels(), input_shape=(5, H), capture="fx")
    c = analyze(gm)
    fc1 = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "fc1")
    assert c.why_frozen(c.group_of[fc1])
