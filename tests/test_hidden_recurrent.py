"""grow_hidden where a recurrent layer reads the stream (issue 39: timm sequencer2d_s grow_hidden was refused, "the
residual stream reaches 'stages_3_blocks_2_rnn_tokens_rnn_h' (module …), which reads it in a way the analysis does
not understand"). An nn.LSTM / GRU takes the stream's coordinates as its input features: its first layer's
input-to-hidden weights read them through their columns, as a Linear does (in both directions when bidirectional),
so new coordinates get new columns and the layer's input_size grows. Spellings: Sequencer's bidirectional LSTMs over
the rows and the columns of a (B, H, W, C) map with `out, _ = rnn(x)`, a GRU fed sequence first (batch_first=False),
a one-way LSTM read as `rnn(x)[0]`; under LayerNorms.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import grow_checked

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SPELLINGS = ["sequencer", "gru", "one way"]


class Mixer(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        if spelling == "sequencer":
            self.rnn_v, self.rnn_h = (nn.LSTM(16, 6, batch_first=True, bidirectional=True) for _ in range(2))
            self.fc = nn.Linear(24, 16)
        elif spelling == "gru":
            self.rnn_h, self.fc = nn.GRU(16, 8, bidirectional=True), nn.Linear(16, 16)
        else:
            self.rnn_h, self.fc = nn.LSTM(16, 8, batch_first=True), nn.Linear(8, 16)

    def forward(self, x):
        b, h, w, c = x.shape
        if self.spelling == "sequencer":
            v, _ = self.rnn_v(x.permute(0, 2, 1, 3).reshape(-1, h, c))
            v = v.reshape(b, w, h, -1).permute(0, 2, 1, 3)
            r, _ = self.rnn_h(x.reshape(-1, w, c))
            return self.fc(torch.cat([v, r.reshape(b, h, w, -1)], dim=-1))
        if self.spelling == "gru":
            r, _ = self.rnn_h(x.reshape(-1, w, c).transpose(0, 1))  # (W, B·H, C): the sequence first
            return self.fc(r.transpose(0, 1).reshape(b, h, w, -1))
        return self.fc(self.rnn_h(x.reshape(-1, w, c))[0].reshape(b, h, w, -1))


class Sequencer(nn.Module):
    """Patches → a 16-wide (B, 4, 4, C) map, two blocks (recurrent mixing, MLP), a final norm, pooled, classified."""

    def __init__(self, spelling: str):
        super().__init__()
        self.embed, self.head = nn.Linear(12, 16), nn.Linear(16, 5)
        self.norms = nn.ModuleList(nn.LayerNorm(16) for _ in range(3))
        self.mixer = Mixer(spelling)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        h = self.embed(x)
        h = h + self.mixer(self.norms[0](h))
        h = h + self.mlp(self.norms[1](h))
        return self.head(self.norms[2](h).mean((1, 2)))


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_recurrent_layer_reading_the_stream_grows(spelling):
    torch.manual_seed(0)
    model = Sequencer(spelling).eval()
    r = grow_checked(model, "x:1x4x4x12", "grow_hidden")
    assert r.targets["hidden"].startswith("16 → 24"), r.targets
    rnn = r.gm.get_submodule("mixer.rnn_h")
    assert rnn.input_size == 24 and rnn.weight_ih_l0.shape[1] == 24
    x = torch.randn(3, 4, 4, 12)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)


class StateFed(nn.Module):
    """The stream given to an LSTM as its initial state: its hidden size, not input features (refused)."""

    def __init__(self):
        super().__init__()
        self.embed, self.rnn, self.norm, self.head = (
            nn.Linear(12, 16),
            nn.GRU(4, 16),
            nn.LayerNorm(16),
            nn.Linear(16, 5),
        )

    def forward(self, x):
        h = self.embed(x)  # (B, 16): the state of one layer
        out, _ = self.rnn(x[:, :4].unsqueeze(0).expand(3, -1, -1), h.unsqueeze(0))
        return self.head(self.norm(out[-1] + h))


def test_the_stream_as_a_recurrent_state_is_refused():
    import graphgrow as gg
    from graphgrow.core.errors import NotApplicable

    gm = gg.trace(StateFed().eval(), input_shape=(1, 12))
    with pytest.raises(NotApplicable, match="beside a given state, or as its state"):
        gg.get_pass("grow_hidden")()(gm)


class Attention(nn.Module):
    """A token mixer whose forward branches on the values (fx cannot trace it: the capture keeps it whole)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if q.abs().sum() > 0:  # a branch on the data
            return self.proj(torch.softmax(q @ k.transpose(1, 2), -1) @ v)
        return x


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.attn, self.final, self.head = (
            nn.Linear(12, 16),
            nn.LayerNorm(16),
            Attention(),
            nn.LayerNorm(16),
            nn.Linear(16, 5),
        )

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.final(h + self.attn(self.norm(h))).mean(1))


@pytest.mark.parametrize("leaf", ["auto", "given"])
def test_a_module_kept_whole_on_the_stream_is_refused_saying_so(leaf):
    """The refusal names the leaf and says its work is not in the graph (and how to capture it), not that the
    analysis misread an op; the sweep counts it as a capture limit."""
    import graphgrow as gg
    from graphgrow.core.errors import NotApplicable
    from tools.sweep_report import reason_class

    gm = gg.trace(Encoder().eval(), input_shape=(1, 6, 12), leaves=("attn",) if leaf == "given" else ())
    with pytest.raises(
        NotApplicable, match=r"'attn' \(module attn\), which the capture kept whole \(Attention, a leaf\)"
    ) as e:
        gg.get_pass("grow_hidden")()(gm)
    assert reason_class(f"{e.value.message} ({e.value.hint})") == "cannot capture"
