"""Streamed verification: the original checkpoint and the grown one (as written, read back from the staging folder)
run side by side, one layer of each in memory at a time, on a seeded batch of token ids.

Both run in window models (stream_plan: the class with one layer and a vocabulary chunk). The first layer's input is
what the class itself computes from the ids (the window's embedding holds just the rows of the ids in the batch, so
embedding scales and position embeddings are the class's own); every later layer gets the stream handed over
through a hook on the window's layer (its `hidden_states` argument replaced), and its output is taken from a hook
too. The residual stream is compared after every original layer (its old coordinates: growth appends the new ones
after them; a copied layer in between is the identity), in eval and in train mode (dropout probabilities set to 0,
the RNG seeded, as the in-memory check does), and the logits at the end, chunk by chunk of the vocabulary: the
window's layer output is replaced by the final stream, so only the norm and the head run on it.

The grown side is the checkpoint as written: a float32 checkpoint is held to the check protocol's tolerance
(core.protocol.REL_TOL); a bfloat16/float16 one to the dtype's own, as core.protocol.LowPrecision defines it: the
larger of the dtype's unit in the last place and the original's own error in that dtype (the original run in
bfloat16 beside its float32 run, at the same boundary), since the rescaled norms are rounded to the dtype when
written.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..core.errors import PreservationError
from ..core.protocol import REL_TOL, LowPrecision, measure, within_tolerance
from ..io.shards import LazyCheckpoint
from .stream_plan import StreamPlan

MODES = ("eval", "train")


class _Stop(Exception):
    """Raised by the output hook once the layer has run: the rest of the window is not needed."""


def _tensor_out(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _load(window: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    own = window.state_dict()
    missing = [k for k in tensors if k not in own]
    if missing:
        raise PreservationError(f"the window model has no tensor {missing[0]!r}")
    with torch.no_grad():
        for k, v in tensors.items():
            own[k].copy_(v.to(own[k].dtype))


def layer_tensors(plan: StreamPlan, reader: LazyCheckpoint, index: int) -> dict[str, torch.Tensor]:
    """Layer `index` of `reader` named as the window's layer 0."""
    head = f"{plan.stack}.{index}."
    return {f"{plan.stack}.0.{k[len(head) :]}": reader.tensor(k) for k in reader.shapes if k.startswith(head)}


def vocab_rows(
    plan: StreamPlan, reader: LazyCheckpoint, rows: list[int], size: int | None = None
) -> dict[str, torch.Tensor]:
    """The vocabulary tensors' `rows` (padded to the window's `size` rows, default the chunk, by repeating the first),
    plus the tensors outside the stack that are not vocabulary-sized (final norm): what a window holds besides its
    layer."""
    padded = rows + [rows[0]] * ((plan.chunk if size is None else size) - len(rows))
    out = {}
    for k in reader.shapes:
        if k.startswith(plan.stack + "."):
            continue
        if k in plan.vocab_dims:
            runs = _runs(padded)
            out[k] = torch.cat([reader.rows(k, a, b) for a, b in runs]) if len(runs) > 1 else reader.rows(k, *runs[0])
        else:
            out[k] = reader.tensor(k)
    return out


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of row indices as (start, stop) ranges, in order."""
    runs: list[list[int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return [(a, b) for a, b in runs]


def run_window(
    window: nn.Module, stack: str, ids: torch.Tensor, mode: str, h_in: torch.Tensor | None, head: bool
) -> torch.Tensor:
    """The window on `ids` in `mode`: its layer's output (its input replaced by `h_in` when given), or with `head`,
    the logits with the layer's output replaced by `h_in`."""
    layer = window.get_submodule(f"{stack}.0")
    got: dict[str, torch.Tensor] = {}

    def before(_m: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if h_in is None or head:
            return None
        if args:
            return (h_in, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": h_in}

    def after(_m: nn.Module, _args: tuple, out: Any) -> Any:
        if head:
            assert h_in is not None
            return (h_in, *out[1:]) if isinstance(out, tuple) else h_in
        got["h"] = _tensor_out(out)
        raise _Stop

    hooks = [layer.register_forward_pre_hook(before, with_kwargs=True), layer.register_forward_hook(after)]
    window.train(mode == "train")
    torch.manual_seed(0)
    try:
        with torch.no_grad():
            out = window(input_ids=ids)
    except _Stop:
        return got["h"]
    finally:
        for h in hooks:
            h.remove()
        window.eval()
    return out.logits if hasattr(out, "logits") else _tensor_out(out)


class _Tally:
    """Errors of one comparison accumulated over pieces (the logits' vocabulary chunks), measured as `measure`."""

    def __init__(self) -> None:
        self.diff2 = self.ref2 = self.max_diff = self.max_ref = 0.0

    def add(self, ref: torch.Tensor, new: torch.Tensor) -> None:
        ref, new = ref.double(), new.double()
        self.diff2 += float(((new - ref) ** 2).sum())
        self.ref2 += float((ref**2).sum())
        self.max_diff = max(self.max_diff, float((new - ref).abs().max()))
        self.max_ref = max(self.max_ref, float(ref.abs().max()))

    def rel(self) -> float:
        return (self.diff2**0.5) / self.ref2**0.5 if self.ref2 > 0 else float(self.diff2 > 0)


def tolerance(dtype: torch.dtype, own_rel_err: float = 0.0) -> float:
    """REL_TOL for float32; for a half-precision checkpoint, LowPrecision's: max(ulp, the original's own error)."""
    if dtype in (torch.bfloat16, torch.float16):
        return LowPrecision(str(dtype).removeprefix("torch."), torch.finfo(dtype).eps, own_rel_err).tolerance
    return REL_TOL


def verify_streamed(
    plan: StreamPlan,
    grown: LazyCheckpoint,
    grown_config: Any,
    progress: Callable[[str], None],
    batch: int = 2,
    length: int = 16,
    seed: int = 0,
) -> dict:
    """The side-by-side check (module docstring); PreservationError naming the first boundary that moved."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(plan.vocab, (batch, length), generator=gen)
    used = sorted(set(ids.flatten().tolist()))
    if len(used) > plan.chunk:
        ids = ids % plan.chunk  # a vocabulary smaller than the batch's distinct ids: ids below one chunk
        used = sorted(set(ids.flatten().tolist()))
    local = torch.tensor([used.index(i) for i in ids.flatten().tolist()]).view_as(ids)
    wo = plan.cls(plan.window_config(no_dropout=True)).float().eval()
    wg = plan.cls(plan.window_config(no_dropout=True, config=grown_config)).float().eval()
    half = plan.stored_dtype in (torch.bfloat16, torch.float16)
    wh = copy.deepcopy(wo).to(plan.stored_dtype) if half else None  # the original in its own dtype: its own error
    first = vocab_rows(plan, plan.checkpoint, used)
    _load(wo, first)
    if wh is not None:
        _load(wh, first)
    _load(wg, vocab_rows(plan, grown, used))
    tol = tolerance(plan.stored_dtype)
    width = None
    ho: dict[str, Any] = dict.fromkeys(MODES)
    hh: dict[str, Any] = dict.fromkeys(MODES)
    hg: dict[str, Any] = dict.fromkeys(MODES)
    worst = {m: 0.0 for m in MODES}
    own = {m: 0.0 for m in MODES}
    for pos, g in enumerate(plan.order):
        progress(f"verifying: layer {pos + 1}/{len(plan.order)} of the grown model beside the original")
        _load(wg, layer_tensors(plan, grown, pos))
        for m in MODES:
            hg[m] = run_window(wg, plan.stack, local, m, hg[m], head=False)
        if g >= plan.layers:
            continue  # a copy: the identity, checked at the next original layer's boundary and at the logits
        tensors = layer_tensors(plan, plan.checkpoint, g)
        _load(wo, tensors)
        if wh is not None:
            _load(wh, tensors)
        for m in MODES:
            ho[m] = run_window(wo, plan.stack, local, m, ho[m], head=False)
            if wh is not None:
                hh[m] = run_window(wh, plan.stack, local, m, hh[m], head=False)
                own[m] = measure(ho[m], hh[m].float(), m).rel_err
            width = ho[m].shape[-1]
            check = measure(ho[m], hg[m][..., :width], m)
            worst[m] = max(worst[m], check.rel_err)
            tol = tolerance(plan.stored_dtype, own[m])
            if not within_tolerance(check.rel_err, check.max_abs_err, check.max_abs_ref, tol):
                raise PreservationError(
                    f"streamed verification: after layer {g} ({m} mode) the grown stream's old coordinates differ "
                    f"from the original's by {check.rel_err:.3g} relative (tolerance {tol:.3g})"
                )
    logits = {m: _Tally() for m in MODES}
    own_logits = {m: _Tally() for m in MODES}
    for start in range(0, plan.vocab, plan.chunk):
        rows = list(range(start, min(start + plan.chunk, plan.vocab)))
        progress(f"verifying: logits {start:,}–{rows[-1]:,} of {plan.vocab:,}")
        original = vocab_rows(plan, plan.checkpoint, rows)
        _load(wo, original)
        if wh is not None:
            _load(wh, original)
        _load(wg, vocab_rows(plan, grown, rows))
        for m in MODES:
            a = run_window(wo, plan.stack, local, m, ho[m], head=True)[..., : len(rows)]
            b = run_window(wg, plan.stack, local, m, hg[m], head=True)[..., : len(rows)]
            logits[m].add(a, b)
            if wh is not None:
                own_logits[m].add(a, run_window(wh, plan.stack, local, m, hh[m], head=True)[..., : len(rows)].float())
    tol = max(tolerance(plan.stored_dtype, own_logits[m].rel()) for m in MODES)
    report: dict = {"tolerance": tol, "boundaries": sum(1 for g in plan.order if g < plan.layers)}
    for m in MODES:
        t = logits[m]
        tol = tolerance(plan.stored_dtype, own_logits[m].rel())
        ok = within_tolerance(t.rel(), t.max_diff, t.max_ref, tol)
        report[m] = {
            "original_own_rel_err": own_logits[m].rel(),
            "stream_max_rel_err": worst[m],
            "logits_rel_err": t.rel(),
            "logits_max_abs_err": t.max_diff,
            "logits_max_abs": t.max_ref,
            "ok": ok,
        }
        if not ok:
            raise PreservationError(
                f"streamed verification: the grown logits ({m} mode) differ from the original's by {t.rel():.3g} "
                f"relative, {t.max_diff:.3g} at most (tolerance {tol:.3g})"
            )
    return report
