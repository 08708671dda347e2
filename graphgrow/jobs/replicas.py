"""Replicas in a process group agreeing on a growth step: who is rank 0, what every rank has, and the same
decision on every rank.

Growth coordination runs on a side group of its own (gloo, on the CPU, whatever backend trains): its
timeout is the one the caller chose, not the training group's (30 minutes by default, and NCCL's waits are
not interruptible), so a rank that died or hangs turns into a DistributedError on the others within that
time. Every exchange is an all-gather of small records; each rank then takes the same decision from the
same list, so either every rank goes on or every rank raises.

Without an initialised process group everything here is the one-process case (rank 0 of 1) and no
collective runs.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from ..core.errors import DistributedError, GraphgrowError, first_line

HINT = (
    "a rank died, hung or was killed during growth; every rank that answered kept its old model — "
    "stop the job and resume from the last checkpoint"
)


def _dist():
    import torch.distributed as dist  # not at import time: `import graphgrow` never pays for torch.distributed

    return dist if dist.is_available() and dist.is_initialized() else None


@dataclass
class Replicas:
    """The ranks of a job and the side group growth talks on (None: one process)."""

    rank: int
    world: int
    group: Any
    timeout: float

    def gather(self, record: dict, phase: str) -> list[dict]:
        """Every rank's `record`, in rank order. A rank that does not answer within the timeout (or died)
        is a DistributedError on every rank that is still running."""
        if self.world == 1:
            return [record]
        dist = _dist()
        out: list[Any] = [None] * self.world
        start = time.perf_counter()
        try:
            dist.all_gather_object(out, record, group=self.group)
        except (RuntimeError, ValueError, OSError) as e:  # DistBackendError is a RuntimeError
            waited = time.perf_counter() - start
            raise DistributedError(
                f"rank {self.rank}: growth stopped while {phase}: not every rank answered "
                f"(waited {waited:.1f} s, timeout {self.timeout:g} s): {first_line(e, 200)}",
                HINT,
            ) from e
        return out

    def barrier(self, phase: str) -> None:
        self.gather({}, phase)


_SIDE_GROUPS: dict[float, tuple[Any, Any]] = {}  # timeout → (the world group it was made in, the side group)


def replicas(timeout: float = 300.0) -> Replicas:
    """This process's place in the job, with a gloo side group whose collectives give up after `timeout` s.
    The side group is made once per timeout (all ranks must ask for it at the same point: a growth step)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return Replicas(0, 1, None, timeout)
    if not timeout > 0:
        raise DistributedError(f"timeout must be a positive number of seconds, got {timeout!r}", "e.g. timeout=300")
    world, side = _SIDE_GROUPS.get(float(timeout), (None, None))
    if world is not dist.group.WORLD:  # first growth step, or a new process group since the last one
        try:
            side = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        except (RuntimeError, ValueError) as e:
            raise DistributedError(
                f"rank {dist.get_rank()}: could not open the growth side group (gloo): {first_line(e, 200)}",
                "growth coordinates over gloo on the CPU: torch must be built with gloo; " + HINT,
            ) from e
        _SIDE_GROUPS[float(timeout)] = (dist.group.WORLD, side)
    return Replicas(dist.get_rank(), dist.get_world_size(), side, timeout)


def tensor_digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """name → sha256 of the tensor's dtype, shape and bytes: equal digests mean bit-identical tensors."""
    out = {}
    for name, t in named:
        h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        data = t.detach().to("cpu").contiguous()
        if data.numel():
            h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def digest(parts: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(parts):
        h.update(f"{name}={parts[name]};".encode())
    return h.hexdigest()


def model_digests(model: nn.Module, skip_buffers: Iterable[str] = ()) -> dict[str, str]:
    """Digests of every parameter and buffer (buffers named in `skip_buffers` left out) and of the graph's code."""
    skip = set(skip_buffers)
    parts = tensor_digests(model.named_parameters())
    parts.update(tensor_digests((n, b) for n, b in model.named_buffers() if n not in skip))
    parts["<code>"] = hashlib.sha256(str(getattr(model, "code", type(model).__name__)).encode()).hexdigest()
    return parts


def first_disagreement(records: list[dict], key: str) -> tuple[int, Any] | None:
    """(rank, its value) of the first rank whose records[key] differs from rank 0's; None when all agree."""
    for rank, r in enumerate(records[1:], start=1):
        if r.get(key) != records[0].get(key):
            return rank, r.get(key)
    return None


def first_differing_tensor(per_rank: list[dict[str, str]]) -> str | None:
    for name in sorted(set().union(*per_rank)):
        if len({p.get(name) for p in per_rank}) > 1:
            return name
    return None


def raise_failures(reps: Replicas, records: list[dict], own: BaseException | None, phase: str) -> None:
    """When any rank reported an error: this rank's own error again (typed) where it failed, else a
    DistributedError naming the first rank that failed and why. The same decision on every rank."""
    failed = [(rank, r["error"]) for rank, r in enumerate(records) if r.get("error")]
    if not failed:
        return
    if own is not None:
        if isinstance(own, GraphgrowError):
            raise own
        raise DistributedError(
            f"rank {reps.rank}: {phase} failed: {type(own).__name__}: {first_line(own, 200)}",
            "every rank keeps its old model",
        ) from own
    rank, why = failed[0]
    more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    raise DistributedError(
        f"rank {reps.rank}: rank {rank} could not grow{more}: {why}",
        "every rank keeps its old model, optimiser and scheduler; fix the cause on that rank",
    )


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {first_line(e, 300)}"
