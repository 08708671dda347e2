"""Why torch.export could not capture a model in train mode, when the reason is the model's own: a forward that
writes its own parameters or buffers in training (Gemma 3n's AltUp clamps its coefficient weights in place; I-BERT's
quantised activations keep a running range, updated by branches on the data). A graph computes outputs from
inputs and weights; an update of the weights inside the forward is state it cannot hold, whatever torch.export's
own message says (a fake tensor among the constants, a guard on a data-dependent value).

Asked only after the export failed: the model is run once in train mode (no gradients, the random generator
forked) and every tensor of its state compared with a copy taken before; the state is then put back.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

# a model whose state is larger is not copied to be diagnosed (the export's own message stands)
MAX_ELEMENTS = 1 << 26


def written_state(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[str]:
    """Names of the parameters and buffers a train-mode forward of `model` on `inputs` changes (values, or the
    tensor a name holds replaced); [] when none does, the forward fails, or the state is too large to copy."""
    state = model.state_dict(keep_vars=True)
    if sum(t.numel() for t in state.values()) > MAX_ELEMENTS:
        return []
    before = {k: t.detach().clone() for k, t in state.items()}
    was = model.training
    try:
        model.train(True)
        with torch.no_grad(), torch.random.fork_rng(), contextlib.redirect_stdout(None):
            model(**inputs)
    except Exception:
        return []
    finally:
        model.train(was)
        after = model.state_dict(keep_vars=True)
        changed = [
            k
            for k, t in before.items()
            if k not in after
            or after[k] is not state[k]
            or after[k].shape != t.shape
            or not _same(after[k].detach(), t)
        ]
        with torch.no_grad():
            for k in changed:
                if k in after and after[k].shape == before[k].shape:
                    after[k].detach().copy_(before[k])
    return changed


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))
    return bool(torch.equal(a, b))
