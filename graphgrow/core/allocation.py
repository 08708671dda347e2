"""A memory limit on code that runs for real: each allocation is sized before it happens.

A pass runs once, on real tensors, under AllocationGuard: every operator that makes a new
tensor is first sized (from its arguments for factories, on the meta device otherwise), and
the one that would take the bytes held by what the pass made past the limit is refused before
it allocates. What the pass made counts while it lives (storages are followed until freed), so
temporaries do not add up. This replaces a dry run of the whole pass on a meta-device copy,
which cost two more copies of the model and the pass's analysis twice.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

aten = torch.ops.aten

# factories whose first argument is the size (their output's bytes follow from it and the dtype)
_SIZED_FACTORIES = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.rand.default,
    aten.randn.default,
    aten.rand.generator,
    aten.randn.generator,
}
_INT64_FACTORIES = {aten.randperm.default, aten.randperm.generator, aten.arange.default}  # size n, int64 unless told
_SIZED_FROM_SELF = {
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
}
_RESIZE = {aten.resize_.default}  # in place, and may grow the storage


class MemoryLimitExceeded(Exception):
    """Raised inside the guarded code; the guard's owner turns it into the user-facing refusal (guard.refusal)."""


def _dtype_size(dtype: torch.dtype | None) -> int:
    dtype = dtype or torch.get_default_dtype()
    return dtype.itemsize


def _numel(size: Any) -> int:
    return math.prod(int(s) for s in size)


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.Generator):
        return None
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


# operators whose one output has the shape and dtype of their first argument, or of their tensor arguments
# broadcast together (sized without running them on the meta device, which costs far more)
_LIKE_FIRST = {
    aten.clone.default,
    aten.neg.default,
    aten.abs.default,
    aten.sqrt.default,
    aten.exp.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
}
_BROADCAST = {
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.add.Scalar,
    aten.sub.Scalar,
    aten.mul.Scalar,
    aten.div.Scalar,
}
# operator → how it is sized; other operators are classed from their schema on first use
_KIND: dict[Any, str] = {
    **dict.fromkeys(_SIZED_FACTORIES, "factory"),
    **dict.fromkeys(_INT64_FACTORIES, "count"),
    **dict.fromkeys(_SIZED_FROM_SELF, "new"),
    **dict.fromkeys(_RESIZE, "resize"),
    **dict.fromkeys(_LIKE_FIRST, "like"),
    **dict.fromkeys(_BROADCAST, "broadcast"),
    aten.index_select.default: "index_select",
    aten.cat.default: "cat",
}


def _kind(func: Any) -> str:
    kind = _KIND.get(func)
    if kind is None:
        returns = func._schema.returns
        # no tensor returned (allclose, item), or only views and in-place results: nothing new to hold
        fresh = any("Tensor" in str(r.type) for r in returns) and not all(r.alias_info is not None for r in returns)
        kind = _KIND[func] = "meta" if fresh else "alias"
    return kind


def requested_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Bytes of the new tensors `func(*args, **kwargs)` would make, without making them; None when the meta
    device cannot tell (an operator whose output size depends on the data: its output is counted after)."""
    kind = _kind(func)
    if kind == "alias":
        return 0
    if kind == "after":
        return None
    if kind == "factory":
        return _numel(args[0]) * _dtype_size(kwargs.get("dtype"))
    if kind == "count" and isinstance(args[0], int):
        return args[0] * (kwargs.get("dtype") or torch.int64).itemsize
    if kind == "new":
        return _numel(args[1]) * _dtype_size(kwargs.get("dtype") or args[0].dtype)
    if kind == "resize":
        return _numel(args[1]) * int(args[0].element_size())
    if kind == "like" and isinstance(args[0], torch.Tensor):
        dtype = kwargs.get("dtype")
        return args[0].numel() * (_dtype_size(dtype) if dtype is not None else args[0].element_size())
    if kind == "index_select":
        self_, dim, index = args[0], args[1], args[2]
        size = int(self_.element_size()) * int(index.numel())
        return int(self_.numel()) // max(int(self_.shape[dim]), 1) * size if self_.dim() else size
    if kind == "cat":
        tensors = [t for t in args[0] if t.numel()]
        return sum(int(t.numel()) for t in tensors) * max((int(t.element_size()) for t in tensors), default=0)
    if kind == "broadcast":
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        floats = [_dtype_size(None)] if any(isinstance(a, float) for a in args) else []  # an int/bool tensor × 0.5
        return _numel(shape) * max([int(t.element_size()) for t in tensors] + floats)
    try:
        out = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
    except Exception:
        _KIND[func] = "after"  # the meta device cannot size it (a data-dependent size): counted once it has run
        return None
    return sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))


class AllocationGuard(TorchDispatchMode):
    """Within it, the tensors made (and still alive) may hold at most `limit` bytes: the allocation that would go
    past it raises MemoryLimitExceeded before it happens, and stays recorded in `refusal` (code that catches
    every exception, as a pass trying alternatives may, cannot hide it: the owner checks `refusal` afterwards).
    Meta-device tensors cost nothing; `peak` is the most the guarded code held at once."""

    def __init__(self, limit: int):
        super().__init__()  # type: ignore[no-untyped-call]
        self.limit = limit
        self.live = 0
        self.peak = 0
        self.refusal: MemoryLimitExceeded | None = None
        self._storages: dict[int, int] = {}  # StorageImpl address → bytes, while it lives

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        needed = requested_bytes(func, args, kwargs)
        if needed and self.live + needed > self.limit:
            self.refusal = MemoryLimitExceeded(
                f"{func.__name__} would allocate {needed:,} bytes with {self.live:,} held (limit {self.limit:,})"
            )
            self.refusal.needed, self.refusal.held = needed, self.live  # type: ignore[attr-defined]
            raise self.refusal
        out = func(*args, **kwargs)
        if needed != 0:  # None (sized only now) or a positive request: follow what it made
            self._follow(out)
        return out

    def _follow(self, out: Any) -> None:
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()
            key, size = storage._cdata, storage.nbytes()
            known = self._storages.get(key)
            if known is None:  # storages keep their Python object while they live: this runs when it is freed
                weakref.finalize(storage, self._freed, key)
            self._storages[key] = size  # a resize_ grows a storage already followed
            self.live += size - (known or 0)
            self.peak = max(self.peak, self.live)

    def _freed(self, key: int) -> None:
        self.live -= self._storages.pop(key, 0)
