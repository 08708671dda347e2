"""torch.export and values read from tensors (capture/data_dependent.py, issue 39): torch.distributions' value checks
are off while exporting (a branch on the data that computes nothing: HF BLT's patcher), and a size or branch that
follows tensor values is refused in graphgrow's words, naming the model's line and the condition (hf longformer,
torchvision's detection models), instead of torch's raw 'Could not guard on data-dependent expression'."""

from __future__ import annotations

import pytest
import torch
from torch import distributions, nn

import graphgrow as gg
from graphgrow.capture.data_dependent import data_dependent_why


class _Entropy(nn.Module):
    """A patcher's entropy, spelled through torch.distributions (which validates logits by their values)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 5)

    def forward(self, x):
        return x.sum(-1, keepdim=True) + distributions.Categorical(logits=self.proj(x)).entropy().unsqueeze(-1)


class _Normal(nn.Module):
    """The same kind of check in another distribution: Normal validates its scale is positive."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return distributions.Normal(self.proj(x), torch.nn.functional.softplus(x) + 0.1).log_prob(x)


@pytest.mark.parametrize("cls", [_Entropy, _Normal])
def test_distributions_are_captured_without_their_value_checks(cls):
    torch.manual_seed(0)
    model = cls().eval()
    gm = gg.trace(model, (2, 8), capture="export")  # 'Could not guard on data-dependent expression' before
    x = torch.randn(3, 8)
    assert torch.allclose(gm(x), model(x), atol=1e-6)
    assert distributions.Distribution._validate_args  # the default is back after capture


class _ItemBranch(nn.Module):
    """Control flow on a value read with .item() (Longformer's `is_global_attn = mask.any().item()`)."""

    def forward(self, x):
        if (x > 0).any().item():
            return x * 2
        return x


class _TruthBranch(nn.Module):
    """The same branch with the tensor's truth read implicitly (`if tensor:`), and through int()."""

    def forward(self, x):
        if x.mean() > 0 and int(x.max() > 1):
            return x * 2
        return x


class _MaskCount(nn.Module):
    """A boolean mask's count (nonzero's length) decides the path."""

    def forward(self, x):
        k = (x > 0).nonzero().shape[0]
        return x * 2 if k > x.shape[-1] else x


@pytest.mark.parametrize("cls", [_ItemBranch, _TruthBranch, _MaskCount])
def test_a_value_read_from_a_tensor_is_refused_in_graphgrows_words(cls):
    with pytest.raises(gg.TraceError) as e:
        gg.trace(cls().eval(), (2, 8), capture="export")
    said = str(e.value)
    assert "needs to decide" in said and "number read from tensor values" in said, said
    assert "test_data_dependent.py:" in said  # the model's own line (this file's)
    assert "Could not guard" not in said


def test_other_failures_keep_torchs_first_line():
    assert data_dependent_why(RuntimeError("shape mismatch")) is None
    m = "Could not guard on data-dependent expression Eq(u1, 1) (unhinted: Eq(u1, 1)).\n\nThe following call raised "
    m += 'this error:\n  File "/x/site-packages/pkg/mod.py", line 7, in f\n    y = x.view(n)\n'
    assert data_dependent_why(RuntimeError(m)).startswith("pkg/mod.py:7 (f: `y = x.view(n)`) needs to decide Eq(u1, 1)")
