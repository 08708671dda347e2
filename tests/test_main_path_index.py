"""The main path follows features, not indices (issue 39: the sweep's mistral4 sequence classifier had no main path,
so deepen found no token stream). A classifier that picks its logits at a position computed from the token ids
(the last real token, or the end-of-sequence token) has a second path from the input to the output, through integer
and boolean tensors; it selects features and carries none, so the stream's tensors are still every feature path's
cut points. Written the ways transformers' heads write it: argmax of the pad mask, a sum of the mask, a boolean
mask index (T5's eos pooling)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.analysis.stages import main_path
from graphgrow.graph.inputs import TensorSpec

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.fast]  # conftest.py

PAD = 0


class Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(c), nn.Linear(c, 2 * c), nn.Linear(2 * c, c)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Classifier(nn.Module):
    def __init__(self, pooling: str):
        super().__init__()
        self.pooling = pooling
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(2))
        self.score = nn.Linear(16, 3)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for b in self.blocks:
            h = b(h)
        logits = self.score(h)
        b = input_ids.shape[0]
        if self.pooling == "argmax":  # LlamaForSequenceClassification: the token before the first pad, or the last
            last = (torch.eq(input_ids, PAD).int().argmax(-1) - 1) % input_ids.shape[-1]
            return logits[torch.arange(b), last]
        if self.pooling == "sum":  # the count of real tokens, gathered
            last = input_ids.ne(PAD).long().sum(-1, keepdim=True) - 1
            return logits.gather(1, last.unsqueeze(-1).expand(-1, -1, 3)).squeeze(1)
        eos = input_ids.eq(PAD)  # T5's: the hidden state at each eos token, the last one classified
        pooled = h[eos, :].view(b, -1, h.shape[-1])[:, -1, :]
        return self.score(pooled)


@pytest.mark.parametrize("pooling", ["argmax", "sum", "mask"])
def test_the_stream_is_the_main_path_and_deepen_lands_on_it(pooling):
    torch.manual_seed(0)
    spec = (TensorSpec("input_ids", (1, 8), "int64", high=50, last=PAD),)
    gm = gg.trace(Classifier(pooling), spec)
    gg.annotate(gm, spec)
    path = [n.name for n in main_path(gm)]
    assert "add_3" in path and "embed" in path, path  # the second block's residual sum, the embedding
    result = gg.get_pass("deepen")()(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok
    assert "token stream" in result.targets["chosen"] or "block" in result.targets["chosen"], result.targets
