"""Every rank agreeing on the outcome of the optimiser carry in a sharded growth step (fsdp.grow_fsdp).

Carrying AdamW's state shard by shard gathers each grown moment on the training group (`DTensor.full_tensor()`), a
collective of every rank. A rank that raised in between (in its own fit of a state tensor, while building the
optimiser, while re-pointing the scheduler) would leave the others inside their next gather until the training
group's timeout (30 minutes by default; NCCL's waits cannot be interrupted). So before each state tensor every rank
says on graphgrow's side group whether it is still carrying (one all-reduce of a flag, under the growth's
`timeout`); a rank that failed says so at the next such exchange instead of joining the gather, then every rank
learns every rank's error (one gather of small records) and raises — the failing rank its own error, the others a
DistributedError naming it — and the caller puts its old state back. One more exchange after the carry hears a rank
that failed after the last state tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.errors import DistributedError, first_line
from . import replicas as rp

PHASE = "carrying the optimiser"


class CarryAgreement:
    """The flag exchanges of one carry on every rank, in the same sequence (see the module docstring)."""

    def __init__(self, reps: rp.Replicas):
        self.reps = reps
        self.settled = False  # every rank has learnt the outcome (or no exchange can run any more): raise, no more talk

    def check(self) -> None:
        """On a rank still carrying: go on when every rank is; else raise as every rank does."""
        if self._exchange(False):
            self._report(None)

    def fail(self, own: BaseException) -> None:
        """On a rank that raised `own`: tell the others at their next exchange, then raise with them."""
        if self.settled:
            raise own
        self._exchange(True)
        self._report(own)

    def _exchange(self, failed: bool) -> bool:
        """Whether any rank failed (an all-reduce of the flags on the side group)."""
        if self.reps.world == 1:
            return failed
        import torch.distributed as dist

        flag = torch.tensor([int(failed)], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.reps.group)
        except (RuntimeError, ValueError, OSError) as e:  # DistBackendError is a RuntimeError
            self.settled = True
            raise DistributedError(
                f"rank {self.reps.rank}: growth stopped while {PHASE}: not every rank answered "
                f"(timeout {self.reps.timeout:g} s): {first_line(e, 200)}",
                rp.HINT,
            ) from e
        return bool(flag.item())

    def _report(self, own: BaseException | None) -> None:
        self.settled = True
        records = self.reps.gather({"error": rp.error_text(own) if own else None}, PHASE)
        rp.raise_failures(self.reps, records, own, PHASE)
        if own is not None:  # a rank's own failure that the gather lost (it cannot: every record holds its error)
            raise own


def checked_fit(agreement: CarryAgreement, fit: Any) -> Any:
    """`fit`, preceded by the exchange on every sharded state tensor (the ones whose fit may gather)."""
    from torch.distributed.tensor import DTensor

    def run(value: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
        if isinstance(value, DTensor):
            agreement.check()
        return fit(value, old, new)

    return run
