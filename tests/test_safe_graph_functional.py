"""Stored graphs hold what capture keeps of torch.nn.functional and of torch.Tensor's methods (issue 39: no "cannot
save" refusal): F's layers are derived (graph_policy.functional_names), not listed one by one; the Tensor methods
ATen cannot vouch for (dtype and device conversions, size queries, Python wrappers of pure ops) are listed by class.
Each spelling is traced with fx, saved, read back without --trust and run: outputs bit-equal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_safe_graph import X, node, payload
from torch import nn

import graphgrow as gg
from graphgrow.io import graph_policy
from graphgrow.io.load import load_model


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _unfold_fold(x):  # VOLO / MobileViT: patches out with F.unfold, back with F.fold
    return F.fold(F.unfold(x, 2, stride=2), x.shape[-2:], 2, stride=2)


def _rms(x):  # timm's fast_norm: F.rms_norm over the last dimension
    return F.rms_norm(x, (x.shape[-1],), eps=1e-6)


def _threshold(x):  # stored under its function's own name, torch.nn.functional._threshold
    return F.threshold(x, 0.1, 0.0)


def _pool_with_indices(x):  # F.max_pool2d(..., return_indices=True) is max_pool2d_with_indices
    y, i = F.max_pool2d(x, 2, return_indices=True)
    return y + F.adaptive_max_pool2d(x, 1, return_indices=True)[0] + i.float()


def _sample(x):  # a flow warp: F.grid_sample on a grid computed from the input
    return F.grid_sample(x, x[:, :2].permute(0, 2, 3, 1).tanh(), align_corners=False)


def _small_layers(x):  # layers no model in the first samples used
    return F.softsign(x) + F.softmin(x, -1) + F.tanhshrink(x) + F.local_response_norm(x, 2) + F.lp_pool2d(x, 2, 1)


def _conversions(x):  # dtype conversions and size queries that are no ATen operator's method
    return x.byte().float() + x.short().float() + x.type(torch.float64).float() / x.nelement() * x.ndimension()


def _unique(x):  # torch.Tensor's and torch.functional's Python wrappers of _unique2
    r = x.round()
    return x + r.unique().sum() + torch.unique(r, return_counts=True)[1].sum() + r.flatten().unique_consecutive().sum()


def _from_constants(x):  # x.new_tensor from the file's plain data; torch.tensordot records out=None
    return torch.tensordot(x, x, dims=([3], [2])).sum(-1).sum(-1) * x.new_tensor([1.0, 2.0, 3.0])[:, None, None]


SPELLINGS = [_unfold_fold, _rms, _threshold, _pool_with_indices, _sample, _small_layers, _conversions, _unique]


@pytest.mark.parametrize("fn", SPELLINGS + [_from_constants], ids=lambda f: f.__name__)
def test_functional_layers_and_tensor_methods_save_and_load(fn, tmp_path):
    gm = gg.trace(_Fn(fn), input_shape=(1, 3, 4, 4), capture="fx")
    f = tmp_path / "m.pt"
    gg.save_model(gm, f)  # each raised 'cannot save the model' before
    back = load_model(f).module
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(back(x), gm(x))


def test_functional_is_derived_with_its_exclusions():
    names = graph_policy.functional_names()
    assert {"unfold", "fold", "rms_norm", "grid_sample", "_threshold", "max_pool2d_with_indices"} <= names
    assert "triplet_margin_with_distance_loss" not in names  # takes a callable: code, not data
    assert not graph_policy.allowed_function("torch.nn.functional.boolean_dispatch")  # defined elsewhere
    assert not graph_policy.allowed_function("torch.nn.functional.torch")  # a module, not a layer
    assert not graph_policy.allowed_function("torch.nn.functional._add_docstr")  # private, held by no public name
    assert graph_policy.allowed_method("nelement") and not graph_policy.allowed_method("storage")


@pytest.mark.parametrize(
    "target", ["torch.nn.functional.triplet_margin_with_distance_loss", "torch.nn.functional.handle_torch_function"]
)
def test_a_stored_functional_outside_the_derivation_is_refused(target, tmp_path):
    nodes = [
        node("x", "placeholder", "x"),
        node("a", "call_function", target, X, X, X),
        node("output", "output", "output", {"node": "a"}),
    ]
    f = tmp_path / "m.grown.pt"
    torch.save(payload(nodes), f)
    with pytest.raises(gg.LoadError, match="safe operations"):
        load_model(f)


def test_out_none_is_no_write_but_out_a_tensor_is(tmp_path):
    """out=None is the signature's default written out; out= a node writes into it (refused as before)."""
    for out, refused in ((None, False), ({"node": "x"}, True)):
        nodes = [
            node("x", "placeholder", "x"),
            node("a", "call_function", "torch.addcmul", X, X, X, out=out),
            node("output", "output", "output", {"node": "a"}),
        ]
        f = tmp_path / f"out{refused}.grown.pt"
        torch.save(payload(nodes), f)
        if refused:
            with pytest.raises(gg.LoadError, match="with out="):
                load_model(f)
        else:
            x = torch.randn(1, 3, 8, 8)
            assert torch.equal(load_model(f).module(x), torch.addcmul(x, x, x))
