"""graphgrow's growable channel groups against Torch-Pruning's prunable ones (benchmarks/compare_tp.py).

Where both sides can change a group, they must see the same layers; every group Torch-Pruning prunes and
graphgrow freezes must carry a reason that makes exact growth impossible. Models where graphgrow still
freezes for other reasons (coupling rules not written yet, issue 28) are strict xfails: when the rules land,
the test passes, the xfail fails, and its mark is to be dropped.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_pruning")
pytest.importorskip("timm")
pytest.importorskip("torchvision")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import compare_tp  # noqa: E402

pytestmark = pytest.mark.slow

# Reasons under which no growth of the group can keep the function exactly.
IMPOSSIBLE = (
    re.compile(r"it is the model's (input|output)"),  # the model's signature would change
    re.compile(r"exact growth is impossible"),  # what a rule says when it has proven so (not "not grown yet")
)

# Models where graphgrow freezes TP-prunable groups for reasons that are not impossibility (none left as measured
# now; a model listed here is a strict xfail until its rules land).
NOT_YET: dict[str, str] = {}
MODELS = (
    "resnet18",
    "mobilenet_v2",
    "densenet121",
    "regnet_y_400mf",
    "timm:ghostnet_100",
    "timm:vit_tiny_patch16_224",
    "timm:resnetv2_50x1_bit",
    "timm:resnest14d",
    "timm:skresnet18",
)


def compared(name: str) -> compare_tp.Compared:
    factory, shape = compare_tp.MODELS[name]
    torch.manual_seed(0)
    return compare_tp.compare(name, factory(), shape)


# one test per model (not one per property): the comparison is the cost, and test workers do not share a cache
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=NOT_YET[n])) if n in NOT_YET else n for n in MODELS],
)
def test_groups_agree_and_every_prunable_group_graphgrow_freezes_cannot_grow_exactly(name):
    r = compared(name)
    assert not r.tp_error and not r.gg_error and r.tp_prunable > 0, (r.tp_error, r.gg_error)
    # where both sides can change a group, they see the same layers
    assert r.differ == [], f"{name}: groups both sides change but couple differently: {r.differ[:3]}"
    assert r.gg_only == [], f"{name}: graphgrow grows groups Torch-Pruning does not prune: {r.gg_only[:3]}"
    assert r.matched + len(r.tp_only) == r.tp_prunable
    for g in r.tp_only:
        assert g["reasons"], f"{name}: {g['layers'][:3]} frozen without a reason"
        assert any(p.search(x) for x in g["reasons"] for p in IMPOSSIBLE), (
            f"{name}: {g['layers'][:3]} frozen for reasons that do not make exact growth impossible: {g['reasons'][:3]}"
        )
