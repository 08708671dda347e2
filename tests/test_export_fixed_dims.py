"""torch.export captures a float input of four or more dimensions (an image, a video) at the example's size in every
dimension but the batch, unless the spec declares a dimension dynamic; token ids, masks and (B, T, C) sequences keep
every dimension dynamic. TF-'same' padding (the pad computed from the input's size) is the case that made symbolic image
sizes cost: timm's tf_mobilenetv3_small_minimal_100 took 200 CPU s to capture, 24 with its size fixed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphgrow.capture.trace import trace
from graphgrow.graph.inputs import fixed_dims, parse_spec


class SamePad(nn.Module):
    """TF 'same' padding: the pad depends on the input's height and width (timm's Conv2dSame does this)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2)

    def forward(self, x):
        ih, iw = x.shape[-2:]
        ph = max((math.ceil(ih / 2) - 1) * 2 + 3 - ih, 0)
        pw = max((math.ceil(iw / 2) - 1) * 2 + 3 - iw, 0)
        return self.conv(F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2]))


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask):
        return self.fc(self.emb(input_ids)) * attention_mask.unsqueeze(-1)


def _size_queries(gm) -> int:
    return sum(1 for n in gm.graph.nodes if "sym_size" in str(n.target) or n.target in ("size", getattr))


def test_which_dimensions_are_fixed():
    spec = parse_spec("x:float32[2,3,8,8],mask:int64[2,8],y:float32[2,3,h=8,w=8],wave:float32[2,16],seq:float32[2,5,8]")
    assert fixed_dims(spec) == {"x": {1, 2, 3}, "y": {1}}


def test_an_image_is_captured_at_its_size_and_still_at_any_batch():
    gm = trace(SamePad(), input_shape=parse_spec("x:float32[2,3,9,9]"), capture="export")
    assert _size_queries(gm) == 0  # the pad is a constant of the example's size
    model = SamePad()
    gm = trace(model, input_shape=parse_spec("x:float32[2,3,9,9]"), capture="export")
    for batch in (1, 3, 5):
        x = torch.randn(batch, 3, 9, 9)
        torch.testing.assert_close(gm(x=x), model(x))


def test_a_declared_dimension_stays_dynamic():
    model = SamePad()
    gm = trace(model, input_shape=parse_spec("x:float32[2,3,h=9,w=9]"), capture="export")
    for size in (9, 12, 15):
        x = torch.randn(2, 3, size, size)
        torch.testing.assert_close(gm(x=x), model(x))


@pytest.mark.parametrize("length", [6, 11])
def test_token_inputs_keep_their_length_dynamic(length):
    model = Tokens()
    gm = trace(model, input_shape=parse_spec("input_ids:int64[2,8],attention_mask:int64[2,8]"), capture="export")
    ids, mask = torch.randint(0, 32, (2, length)), torch.ones(2, length, dtype=torch.int64)
    torch.testing.assert_close(gm(input_ids=ids, attention_mask=mask), model(ids, mask))


@pytest.mark.parametrize("length", [3, 7])
def test_a_sequence_of_features_keeps_its_length_dynamic(length):
    """(B, T, C) float features are a sequence, not an image: run at other lengths than captured."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    gm = trace(model, input_shape=parse_spec("input:float32[2,5,8]"), capture="export")
    x = torch.randn(2, length, 8)
    torch.testing.assert_close(gm(input=x), model(x))
