"""add_branch in a model whose classifier starts at zero (issue 39: timm sequencer2d_s add_branch was refused, "every
conv a branch could run beside is dead for it"). timm zero-initialises Sequencer's head: at initialisation no gradient
reaches any conv, so every place looked dead. Training moves the head at its first step and then every place hears
the output, as verification's training of a zero-headed model shows: a place is dead only when it stays silent once
the model's own zero weights have moved. Spellings of the zero head: nn.Linear, a 1×1 Conv2d on the pooled map,
F.linear on a parameter. The strict side: a model whose convs reach the output only through a product with 0 (no
weight that training moves) is still refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SPELLINGS = ["linear", "conv head", "functional"]


class ZeroHeadCNN(nn.Module):
    def __init__(self, spelling: str, cut: bool = False):
        super().__init__()
        self.spelling, self.cut = spelling, cut
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1, self.conv2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)
        self.head = nn.Conv2d(8, 5, 1)
        self.w = nn.Parameter(torch.zeros(5, 8))
        for p in (self.fc.weight, self.head.weight):
            nn.init.zeros_(p)

    def forward(self, x):
        h = F.relu(self.stem(x))
        y = h + self.conv2(F.relu(self.conv1(h)))
        if self.cut:  # what the convs compute reaches the output only times 0: dead for good
            y = h + 0.0 * y
        if self.spelling == "linear":
            return self.fc(y.mean((2, 3)))
        if self.spelling == "conv head":
            return self.head(y.mean((2, 3), keepdim=True)).flatten(1)
        return F.linear(y.mean((2, 3)), self.w)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_add_branch_grows_behind_a_zero_head(spelling):
    torch.manual_seed(0)
    gm = gg.trace(ZeroHeadCNN(spelling).eval(), input_shape=(1, 3, 8, 8))
    versions = [p._version for p in gm.parameters()]
    r = gg.get_pass("add_branch")()(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok, r.preservation
    assert not r.preservation.dead
    assert not any(p.detach().any() for n, p in gm.named_parameters() if n in ("fc.weight", "head.weight", "w"))
    assert [p._version for p in gm.parameters()] == versions  # not written, not even put back (the CLI's check)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_convs_cut_off_by_a_constant_zero_are_still_dead(spelling):
    torch.manual_seed(0)
    gm = gg.trace(ZeroHeadCNN(spelling, cut=True).eval(), input_shape=(1, 3, 8, 8))
    with pytest.raises(gg.NotApplicable, match="dead for it|would be dead|no Conv2d"):
        gg.get_pass("add_branch")()(gm)


def test_every_place_dead_for_good_is_classed_as_no_place():
    """Only the stem could take a branch, and it is not a branch site (it reads the raw input): with the convs after
    it cut off by a constant 0 every site stays dead once the zero head has moved, a stated impossibility."""
    from tools.sweep_report import reason_class

    class Cut(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.conv1, self.conv2 = (
                nn.Conv2d(3, 8, 3, padding=1),
                *(nn.Conv2d(8, 8, 3, padding=1) for _ in range(2)),
            )
            self.fc = nn.Linear(8, 5)
            nn.init.zeros_(self.fc.weight)

        def forward(self, x):
            y = self.conv2(F.relu(self.conv1(F.relu(self.stem(x)))))
            return self.fc((0.0 * y).mean((2, 3))) + x.mean((1, 2, 3))[:, None]

    torch.manual_seed(0)
    with pytest.raises(gg.NotApplicable, match="also once the model's zero weights have moved") as e:
        gg.get_pass("add_branch")()(gg.trace(Cut().eval(), input_shape=(1, 3, 8, 8)))
    assert reason_class(f"{e.value.message} ({e.value.hint})") == "no place"
