"""Why torch.export could not capture a model in train mode, when the reason is the model's own: a forward that
writes its own weights in training (Gemma 3n's AltUp clamps its coefficient weights in place, through .data) or
replaces its buffers (I-BERT's quantised activations keep a running range, updated by branches on the data). A
graph computes outputs from inputs and weights; an update of the weights inside the forward is state it cannot
hold, whatever torch.export's own message says (a fake tensor among the constants, a guard on a data-dependent
value). A buffer updated in place (batch norm's running statistics) is not counted: the export holds that.

Asked only after the export failed: the model is run once in train mode (no gradients, the random generator
forked) under a dispatch mode that records every ATen op writing into a parameter's storage (even where the values
stay: a clamp to ±120 of small weights), and the buffers' tensors are compared before and after. Parameters
written are put back from a copy when the state is small enough to copy (MAX_ELEMENTS); a larger model keeps what
its forward wrote, as a training step of it would.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.errors import TraceError

# a model whose parameters are larger is not copied (they keep what the diagnostic forward wrote)
MAX_ELEMENTS = 1 << 26


class StateWrite(Exception):
    """Raised by a `_Writes(stop=True)` before an op writes into one of its storages (the op does not run)."""


class _Writes(TorchDispatchMode):
    """Records the names of the tensors in `storages` (storage pointer → name) that an op writes into; with `stop`,
    raises StateWrite instead, before the op writes."""

    def __init__(self, storages: dict[int, str], stop: bool = False):
        super().__init__()
        self.storages, self.written, self.stop = storages, set[str](), stop

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, torch.Tensor) and v.numel() and _storage(v) in self.storages:
                if self.stop:
                    raise StateWrite(self.storages[_storage(v)])
                self.written.add(self.storages[_storage(v)])
        return func(*args, **kwargs)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def written_state(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[str]:
    """Names of the parameters a train-mode forward of `model` on `inputs` writes and of the buffers it replaces
    by other tensors, in the model's order; [] when none, or when the forward fails."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    copied = sum(p.numel() for p in params.values()) <= MAX_ELEMENTS
    saved = {k: p.detach().clone() for k, p in params.items()} if copied else {}
    mode = _Writes({_storage(p): k for k, p in params.items() if p.numel()})
    was = model.training
    try:
        model.train(True)
        with torch.no_grad(), torch.random.fork_rng(), contextlib.redirect_stdout(io.StringIO()), mode:
            model(**inputs)
    except Exception:
        return []
    finally:
        model.train(was)
        with torch.no_grad():
            for k in mode.written & set(saved):
                params[k].copy_(saved[k])
    replaced = {k for k, b in model.named_buffers() if k in buffers and b is not buffers[k]}
    return [k for k in [*params, *buffers] if k in mode.written or k in replaced]


def self_write_refusal(model: nn.Module, inputs: dict[str, torch.Tensor]) -> TraceError | None:
    """The refusal to give when a train-mode export failed because the forward writes its own state; None when it
    writes none (torch.export's own message is then the reason)."""
    written = written_state(model, inputs)
    if not written:
        return None
    more = f" and {len(written) - 1} more" if len(written) > 1 else ""
    return TraceError(
        f"cannot capture {type(model).__name__} in train mode: its forward writes its own state, "
        f"'{written[0]}'{more} (a weight clamped in place, a running range kept in a buffer); a graph "
        f"computes its outputs from its weights and cannot hold updates of them",
        "graphgrow verifies growth in train mode too; turn the update off where the model's config has an "
        "option for it (Gemma 3n: altup_coef_clip=None)",
    )
