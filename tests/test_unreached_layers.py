"""New entries in an old layer that the output does not reach in the original model either (issue 39: grow_hidden on
DeepSeek V3.2's, GLM-MoE-DSA's, AXK2's, Dots3's and HY-V4's sparse attention was refused, 'the model's output does
not depend on ...indexer.weights_proj': the indexer scores tokens and only topk's indices are read, so its weights
get no gradient from the output; HRM's initial state is read detached). Widening the stream must widen that layer's
input too; its new columns are as trainable as its old ones. So the growth is accepted when the rest of it learns,
and the report names those entries. A growth where nothing new learns is still refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import grow_checked
from torch import nn

import graphgrow as gg
from graphgrow.graph.inputs import parse_spec

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class IndexOnlyScorer(nn.Module):
    """A stream with one pre-norm attention block whose keys are chosen by a scorer (DeepSeek's sparse attention): the
    scorer reads the stream, and only the indices of its best tokens are used (`how`: topk's, argsort's, argmax's and
    argmin's), to build the attention's mask."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.embed, self.norm = nn.Embedding(20, 8), nn.LayerNorm(8)
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.scorer = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        self.final, self.head = nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, ids):
        x = self.embed(ids)
        h = self.norm(x)
        scores = self.scorer(h).squeeze(-1)
        if self.how == "topk":
            idx = scores.topk(2, dim=-1).indices
        elif self.how == "argsort":
            idx = scores.argsort(dim=-1, descending=True)[:, :2]
        else:
            idx = torch.stack([scores.argmax(-1), scores.argmin(-1)], dim=-1)
        b, t = ids.shape
        mask = x.new_full((b, t, t), float("-inf")).scatter(-1, idx[:, None, :].expand(b, t, 2), 0.0)
        q, k, v = (f(h).unsqueeze(1) for f in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1)).squeeze(1)
        x = x + self.o(att)
        return self.head(self.final(x))


@pytest.mark.parametrize("how", ["topk", "argsort", "argmax and argmin"])
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_the_stream_grows_through_a_scorer_read_only_by_its_indices(how, capture):
    torch.manual_seed(0)
    r = grow_checked(IndexOnlyScorer(how), "ids:2x6:int64", "grow_hidden", capture)
    assert r.gm.get_submodule("scorer.0").in_features == r.gm.get_submodule("q").in_features > 8
    assert [p for p in r.preservation.unreached if p.startswith("scorer")], r.preservation.unreached
    assert all(p.startswith("scorer") for p in r.preservation.unreached), r.preservation.unreached
    assert "scorer.0.weight" not in r.preservation.trainable  # honest: reported as unreached, not as learning


class DetachedInit(nn.Module):
    """HRM's initial state: a parameter on the stream read detached (HRM's loops run under no_grad)."""

    def __init__(self):
        super().__init__()
        self.embed, self.init, self.norm = nn.Embedding(10, 8), nn.Parameter(torch.randn(8)), nn.LayerNorm(8)
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, ids):
        x = self.embed(ids) + self.init.detach()
        return self.head(self.norm(x + self.fc(self.norm(x))))


def test_a_detached_parameter_on_the_stream_grows_and_is_reported():
    gm = gg.trace(DetachedInit(), input_shape=parse_spec("ids:1x4:int64"))
    r = gg.get_pass("grow_hidden")()(gm)
    assert r.gm.init.shape[0] > 8 and r.preservation.unreached == ["init"]
    assert r.preservation.to_json()["unreached_parameters"] == ["init"]


def test_growing_only_the_unreached_layer_is_still_refused():
    """grow_width of the scorer's hidden layer: every new parameter is in a layer the output never reaches, so
    nothing new learns; refused as before."""
    gm = gg.trace(IndexOnlyScorer("topk"), input_shape=parse_spec("ids:2x6:int64"), capture="fx")
    with pytest.raises(
        (gg.NotApplicable, gg.PreservationError), match="output does not depend on|contribution is dead"
    ):
        gg.get_pass("grow_width")(target="scorer.0")(gm)
