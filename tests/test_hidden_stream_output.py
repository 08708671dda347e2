"""grow_hidden on a model that returns its residual stream (a backbone built without a classifier: timm's feature
models, num_classes=0, whose head is an Identity): the stream's width is the output's shape, so growing it is
impossible by construction, and the refusal says so in words the sweep counts as a stated impossibility (issue 39:
timm eva02_tiny, deepseek_vit, gemma4_vit, sam2_hiera_tiny were counted as 'other')."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import graphgrow as gg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from sweep_report import reason_class  # noqa: E402
from sweep_targets import STATED  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class Backbone(nn.Module):
    """Two pre-norm blocks on (B, T, 8) tokens; `out` says how the stream leaves the model."""

    def __init__(self, out: str):
        super().__init__()
        self.out = out
        self.proj = nn.Linear(6, 8)
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.ln1, self.ln2, self.norm = nn.LayerNorm(8), nn.LayerNorm(8), nn.LayerNorm(8)
        self.head = nn.Identity()  # timm's head at num_classes=0

    def forward(self, x):
        x = self.proj(x)
        x = x + self.fc1(self.ln1(x))
        x = x + self.fc2(torch.relu(self.ln2(x)))
        if self.out == "pooled":  # timm: global average pool, fc_norm, Identity head
            return self.head(self.norm(x.mean(dim=1)))
        if self.out == "cls":  # the first token, normed
            return self.head(self.norm(x)[:, 0])
        return self.norm(x)  # the last hidden state itself


class WithClassifier(Backbone):
    def __init__(self):
        super().__init__("pooled")
        self.head = nn.Linear(8, 3)


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("out", ["pooled", "cls", "tokens"])
def test_a_returned_stream_is_a_stated_impossibility(out, capture):
    gm = gg.trace(Backbone(out), input_shape=(2, 5, 6), capture=capture)
    with pytest.raises(gg.NotApplicable, match="is a model output: the model returns the stream itself") as e:
        gg.get_pass("grow_hidden")()(gm)
    assert reason_class(str(e.value)) in STATED, str(e.value)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_classifier_reading_the_stream_grows(capture):
    gm = gg.trace(WithClassifier(), input_shape=(2, 5, 6), capture=capture)
    r = gg.get_pass("grow_hidden")()(gm)
    assert r.preservation.eval.ok and r.preservation.trainable_ok
    assert r.gm.get_submodule("head").in_features > 8
