"""The old model's state moved out of memory while the grown one is built, and put back if growth fails
(fsdp.grow_fsdp with release_old on the layer-by-layer path).

A `Spill` writes each storage it is given to one temporary file and frees it (the storage resized to nothing: the
tensors, the Parameters, FSDP's views and the optimiser's state dict stay the same objects, with no memory behind
them); `restore` reads every storage back bit for bit. A file, not a host copy: in a job on the CPU the host *is* the
device, so a copy in memory would count the old state twice — the very thing releasing it avoids. The file is
unlinked from the start (tempfile.TemporaryFile, in $TMPDIR): it goes when closed or when the process dies.

`borrow` reads some released storages back for a while and frees them again (their bytes stay in the file): the
optimiser's moments leave before growth starts and come back one at a time when the carry reads them.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_CHUNK = 8 * 2**20  # bytes copied through the host buffer at a time


class Spill:
    """Storages written to a temporary file and freed, in the order given; `restore` puts them all back."""

    def __init__(self, directory: str | None = None):
        self._file = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 - open until restore or close
        self._saved: list[tuple[Any, int, int]] = []  # storage, its bytes, where they start in the file
        self._index: dict[int, int] = {}  # a storage's StorageImpl (`_cdata`: kept across resizes) → its _saved entry
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self.nbytes = 0  # written and freed
        self.kept = 0  # left in place: storages torch does not let resize (e.g. a tensor once viewed with .numpy())
        self._kept: set[int] = set()

    def release(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Each tensor's storage to the file, then freed (a storage already released or empty is skipped: views and
        tied parameters share one)."""
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            n = storage.nbytes()
            if not n or storage.data_ptr() in self._kept:
                continue
            if not storage.resizable():
                self._kept.add(storage.data_ptr())
                self.kept += n
                continue
            offset = self._file.seek(0, 2)
            src = _as_bytes(storage)
            for start in range(0, n, _CHUNK):
                chunk = self._host(min(_CHUNK, n - start))
                chunk.copy_(src[start : start + chunk.numel()])
                self._file.write(chunk.numpy())
            del src
            storage.resize_(0)
            self._index[storage._cdata] = len(self._saved)
            self._saved.append((storage, n, offset))
            self.nbytes += n

    @contextmanager
    def borrow(self, tensors: Iterable[torch.Tensor]) -> Iterator[None]:
        """The storages of `tensors` that this spill released, read back for the `with` block and freed again at its
        end (the file keeps their bytes: `restore` still puts them back). Others are left as they are."""
        entries = []
        for t in tensors:
            k = self._index.get(t.untyped_storage()._cdata)
            if k is not None and not self._saved[k][0].nbytes():
                entries.append(self._saved[k])
                self._read(*self._saved[k])
        try:
            yield
        finally:
            for storage, _, _ in entries:
                storage.resize_(0)

    def restore(self) -> None:
        """Every released storage back to its size and bytes; then the file is closed."""
        for entry in self._saved:
            self._read(*entry)
        self._saved.clear()
        self._index.clear()
        self.close()

    def _read(self, storage: Any, n: int, offset: int) -> None:
        """One storage back to its size and bytes from the file."""
        storage.resize_(n)
        dst = _as_bytes(storage)
        self._file.seek(offset)
        for start in range(0, n, _CHUNK):
            chunk = self._host(min(_CHUNK, n - start))
            if self._file.readinto(chunk.numpy()) != chunk.numel():
                raise OSError(f"the spill file ended early ({offset + start} + {chunk.numel()} bytes)")
            dst[start : start + chunk.numel()].copy_(chunk)

    def close(self) -> None:
        """Drop the file (after success: the old state is not needed any more)."""
        self._file.close()

    def _host(self, n: int) -> torch.Tensor:
        """n bytes of one host buffer reused for every copy (numpy() pins it: it is never resized)."""
        if self._buffer.numel() < n:
            self._buffer = torch.empty(n, dtype=torch.uint8)
        return self._buffer[:n]


def _as_bytes(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def local_state(params: Iterable[torch.Tensor], optimizer: Any = None) -> list[torch.Tensor]:
    """The local tensors of `params` (a DTensor's shard), their gradients and, with `optimizer`, their per-parameter
    state (AdamW's moments; not the step counts)."""
    from torch.distributed.tensor import DTensor

    out = []
    for p in params:
        state = optimizer.state.get(p, {}).values() if optimizer is not None else ()
        for t in (p, p.grad, *state):
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                out.append(t.to_local() if isinstance(t, DTensor) else t)
    return out


def local_moments(optimizer: Any) -> list[torch.Tensor]:
    """The local tensors of the optimiser's per-parameter state (AdamW's moments; not the step counts)."""
    from torch.distributed.tensor import DTensor

    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for t in optimizer.state.get(p, {}).values():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    out.append(t.to_local() if isinstance(t, DTensor) else t)
    return out
