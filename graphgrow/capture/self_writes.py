"""Why torch.export could not capture a model in train mode, when the reason is the model's own: a forward that
writes its own parameters or buffers in training (Gemma 3n's AltUp clamps its coefficient weights in place; I-BERT's
quantised activations keep a running range, updated by branches on the data). A graph computes outputs from
inputs and weights; an update of the weights inside the forward is state it cannot hold, whatever torch.export's
own message says (a fake tensor among the constants, a guard on a data-dependent value).

Asked only after the export failed: the model is run once in train mode (no gradients, the random generator
forked) and every tensor of its state compared with a copy taken before, the state then put back; a model too
large to copy (Gemma 3n's vision tower: 300 M parameters) is compared by a sum and a sum of squares per tensor,
and keeps what its forward wrote, as a training step of it would.
"""

from __future__ import annotations

import contextlib
import io

import torch
from torch import nn

# a model whose state is larger is compared by fingerprints, not a copy
MAX_ELEMENTS = 1 << 26


def written_state(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[str]:
    """Names of the parameters and buffers a train-mode forward of `model` on `inputs` changes (values, or the
    tensor a name holds replaced); [] when none does or the forward fails."""
    state = model.state_dict(keep_vars=True)
    copied = sum(t.numel() for t in state.values()) <= MAX_ELEMENTS
    before = {k: t.detach().clone() if copied else _fingerprint(t) for k, t in state.items()}
    was = model.training
    try:
        model.train(True)
        with torch.no_grad(), torch.random.fork_rng(), contextlib.redirect_stdout(io.StringIO()):
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
            or (after[k].shape != t.shape if copied else _fingerprint(after[k]) != t)
            or (copied and not _same(after[k].detach(), t))
        ]
        with torch.no_grad():
            for k in changed if copied else ():
                if k in after and after[k].shape == before[k].shape:
                    after[k].detach().copy_(before[k])
    return changed


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))
    return bool(torch.equal(a, b))


def _fingerprint(t: torch.Tensor) -> tuple:
    x = t.detach()
    x = (x.abs() if x.is_complex() else x).double().nan_to_num()
    return (t.dtype, tuple(t.shape), float(x.sum()), float((x * x).sum()))
