"""One index along a dim that is not the channels' (`x.select(d, i)`, `torch.select`, `x[:, :, i]`) keeps every
channel: the coupling analysis follows it as it follows `x[:, 0]` (issue 39: hf moshi's grow_width was refused, 'no
layer in this model has a channel group that can grow': its gated MLP cuts fc1's output as `view(B, T, 2, -1)` and
takes the two halves with `select(2, 0)` and `select(2, 1)`, which froze the MLP's hidden group; torch.export writes
every `x[:, :, i]` of a scan over time as `select`). A slice bound read at run time on another dim
(`y[:, :, :seq_len]`, a causal conv's padding cut away) keeps every channel too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.analysis.coupling import analyze

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def halves(h: torch.Tensor, spelling: str) -> tuple[torch.Tensor, torch.Tensor]:
    b, t = h.shape[0], h.shape[1]
    if spelling == "view + select method":  # Moshi's gating
        v = h.view(b, t, 2, -1)
        return v.select(2, 0), v.select(2, 1)
    if spelling == "reshape + torch.select, negative dim":
        v = h.reshape(b, t, 2, -1)
        return torch.select(v, -2, 0), torch.select(v, -2, 1)
    if spelling == "reshape + index with ...":
        v = h.reshape(b, t, 2, h.shape[-1] // 2)
        return v[..., 0, :], v[..., 1, :]
    v = h.view(b, t, 2, -1)  # "view + integer index"
    return v[:, :, 0], v[:, :, 1]


class GatedMLP(nn.Module):
    def __init__(self, spelling: str, d: int = 8, hidden: int = 12):
        super().__init__()
        self.fc1, self.fc2, self.spelling = nn.Linear(d, 2 * hidden), nn.Linear(hidden, d), spelling
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        a, g = halves(self.fc1(x), self.spelling)
        return self.head(x + self.fc2(F.silu(a) * g))


class TimeScan(nn.Module):
    """A recurrence over time written with one index per step (`h[:, :, t]` / `h.select(2, t)`), stacked back: each
    channel's state is its own; the causal conv's padding cut with a bound read at run time."""

    def __init__(self, spelling: str, c: int = 6, steps: int = 7):
        super().__init__()
        self.inp, self.conv = nn.Conv1d(4, c, 1), nn.Conv1d(c, c, 3, padding=2, groups=c)
        self.decay = nn.Parameter(torch.rand(c) * 0.5 + 0.25)
        self.out, self.spelling, self.steps = nn.Conv1d(c, 4, 1), spelling, steps

    def forward(self, x):
        seq = x.shape[-1]
        h = self.conv(self.inp(x))[:, :, :seq]
        state, steps = torch.zeros_like(h[:, :, 0]), []
        for t in range(self.steps):
            step = h.select(2, t) if self.spelling == "select" else h[:, :, t]
            state = state * self.decay + step
            steps.append(state)
        return self.out(torch.stack(steps, dim=-1))


GATED = ["view + select method", "reshape + torch.select, negative dim", "reshape + index with ...", "view + index"]


def grow(gm, target: str):
    r = gg.get_pass("grow_width")(target=target)(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok, r.preservation
    return r


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("spelling", GATED)
def test_a_gated_mlp_cut_by_select_grows_both_halves(spelling, capture):
    torch.manual_seed(0)
    gm = gg.trace(GatedMLP(spelling), input_shape=(2, 5, 8), capture=capture)
    c = analyze(gm)
    fc1 = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "fc1")
    assert not c.why_frozen(c.group_of[fc1]), c.why_frozen(c.group_of[fc1])
    r = grow(gm, "fc1")
    assert r.gm.get_submodule("fc1").out_features > 24
    assert r.gm.get_submodule("fc2").in_features == r.gm.get_submodule("fc1").out_features // 2


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("spelling", ["select", "integer index"])
def test_a_scan_over_time_by_select_grows_its_channels(spelling, capture):
    torch.manual_seed(0)
    gm = gg.trace(TimeScan(spelling), input_shape=(2, 4, 7), capture=capture)
    r = grow(gm, "inp")
    assert r.gm.get_submodule("conv").out_channels == r.gm.get_submodule("inp").out_channels > 6
    assert r.gm.get_submodule("out").in_channels == r.gm.get_submodule("inp").out_channels


def test_select_of_the_channel_dim_still_freezes():
    class PickOne(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.head = nn.Linear(4, 6), nn.Linear(5, 2)

        def forward(self, x):
            return self.head(self.fc(x).view(x.shape[0], 3, 2, 3).select(-1, 0).repeat(1, 1, 3)[..., :5])

    gm = gg.trace(PickOne(), input_shape=(2, 3, 4), capture="fx")
    c = analyze(gm)
    fc = next(n.name for n in gm.graph.nodes if n.target == "fc")
    assert c.why_frozen(c.group_of[fc])


class ConvScale(nn.Module):
    """A per-channel gain read through a view: `g.unsqueeze(1)` (a dim, not a size: never rewritten as the channel
    count), `g[:, None]`, or computed from a parameter (`g.exp()`: no rule resizes it, so the group freezes)."""

    def __init__(self, spelling: str, c: int = 6):
        super().__init__()
        self.a, self.b, self.spelling = nn.Conv1d(3, c, 1), nn.Conv1d(c, 3, 1), spelling
        self.g = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x):
        g = {"unsqueeze(1)": lambda: self.g.unsqueeze(1), "exp": lambda: self.g.exp().unsqueeze(1)}[self.spelling]()
        return self.b(self.a(x) * g)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_gain_unsqueezed_by_dim_grows_with_its_channels(capture):
    torch.manual_seed(0)
    gm = gg.trace(ConvScale("unsqueeze(1)"), input_shape=(2, 3, 5), capture=capture)
    r = grow(gm, "a")
    assert r.gm.get_parameter("g").shape[0] == r.gm.get_submodule("a").out_channels > 6


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_gain_computed_from_a_parameter_freezes_instead_of_staying_small(capture):
    gm = gg.trace(ConvScale("exp"), input_shape=(2, 3, 5), capture=capture)
    c = analyze(gm)
    a = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "a")
    assert c.why_frozen(c.group_of[a])
    with pytest.raises(gg.NotApplicable):
        gg.get_pass("grow_width")(target="a")(gm)


class TokenGain(nn.Module):
    def __init__(self, d: int = 6):
        super().__init__()
        self.a, self.b, self.g = nn.Linear(4, d), nn.Linear(d, 4), nn.Parameter(torch.rand(d))

    def forward(self, x):
        return self.b(self.a(x) * self.g.exp())  # one value per channel, computed: the same for every token


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_computed_vector_per_channel_freezes_with_the_reason(capture):
    gm = gg.trace(TokenGain(), input_shape=(2, 3, 4), capture=capture)
    c = analyze(gm)
    a = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "a")
    assert any("a value per channel the growth would not resize" in w for w in c.why_frozen(c.group_of[a]))
    with pytest.raises(gg.NotApplicable):
        gg.get_pass("grow_width")(target="a")(gm)
