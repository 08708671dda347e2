"""What `make test-quick` (the `fast` tests) must still cover however it is trimmed: every module of the package
imports (a broken import in a module only slow tests reach would otherwise wait for `make test`), and every
registered pass runs once on a small model, verified or refused with a reason."""

from __future__ import annotations

import importlib
import pkgutil

import graphgrow.passes
import pytest
import torch
from conftest import small_cnn
from torch import nn

import graphgrow as gg


def _modules() -> list[str]:
    names = set()
    for pkg in (gg, graphgrow.passes):  # graphgrow.passes lives in passes/ (pyproject's package-dir)
        names.update(m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."))
    return sorted(names)


def test_every_module_imports():
    modules = _modules()
    assert len(modules) > 100 and "graphgrow.passes.grow_width" in modules
    for name in modules:
        importlib.import_module(name)


class TinyBlock(nn.Module):
    """A pre-norm transformer block (attention heads, an MLP hidden width): what grow_heads and grow_hidden grow."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


@pytest.mark.parametrize("name", gg.pass_names())
def test_every_pass_runs_once_on_a_small_model(name):
    """Each pass with its defaults on a small CNN and a tiny transformer block: verified, or refused with a reason
    (NotApplicable), never another error. (Acceptance on models made for each pass: the pass's own fast tests.)"""
    torch.manual_seed(0)
    for model, shape in ((small_cnn(8), (2, 3, 16, 16)), (TinyBlock(), (2, 5, 16))):
        gm = gg.trace(model.eval(), shape)
        try:
            result = gg.get_pass(name)()(gm)
        except gg.NotApplicable as e:
            assert str(e), name
            continue
        p = result.preservation  # None: nothing changed (fold on a model with nothing to fold)
        assert p is None or (p.eval.ok and (p.train is None or p.train.ok) and p.trainable_ok), name
