"""How much a pass may add, checked before it is allocated.

A pass runs once, for real, under an allocation guard (allocation.py): the allocation that would take
what the pass holds past `--max-memory` is refused before it happens. The grown model is then sized
before anything else runs on it: the parameters it added (`--max-params`), and what verification
will allocate (its activations at the largest batch, estimated on the meta device, and the
trainability check's gradients) plus the new weights. The defaults keep a typo or a growth far too
large from allocating for minutes; raise them with `--max-params` / `--max-memory` (Python:
`Pipeline(..., limits=Limits(...))`).

Fail closed: nothing real is run unbounded. A model the meta device cannot run (it reads numbers from its data)
is measured on one real forward under an allocation guard at the limit (budget_measure.py), and the command says
so in a note; one that bakes in the batch size (it runs on the meta device at batch 1, not at the verification
batch) is refused with the reason unless the user lifted the limit explicitly (`--max-memory none`: NO_LIMIT).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn

from ..core.allocation import AllocationGuard
from ..core.errors import InputError, NotApplicable, ValidationError
from ..graph.fx_edit import new_parameters, upstream_parameters
from ..graph.inputs import InputSpec, is_positional
from ..graph.shapes import annotate, state_bytes
from .budget_estimate import NoEstimate, activation_bytes, estimate_batch, meta_copy
from .budget_measure import measured_bytes

DEFAULT_MAX_NEW_PARAMS = 100_000_000  # parameters one pass may add
DEFAULT_MAX_MEMORY = 8 << 30  # bytes of activations a model may need at the largest batch it is run at (estimate_batch)
NO_LIMIT = 1 << 62  # a limit the user lifted (`none`): nothing is estimated against it


@dataclass(frozen=True)
class Limits:
    """The limits of one command (--max-params, --max-memory), passed to every place that reads them: no global."""

    max_new_params: int = DEFAULT_MAX_NEW_PARAMS
    max_memory: int = DEFAULT_MAX_MEMORY

    @classmethod
    def lifted(cls) -> Limits:
        return cls(NO_LIMIT, NO_LIMIT)

    @classmethod
    def parse(cls, max_params: str | int | None = None, max_memory: str | int | None = None) -> Limits:
        """From the command's flags (None: the default); a bad value is an InputError naming the flag, raised
        where the job starts, not while the command line is read."""
        return cls(
            DEFAULT_MAX_NEW_PARAMS if max_params is None else parse_limit(max_params, "--max-params"),
            DEFAULT_MAX_MEMORY if max_memory is None else parse_limit(max_memory, "--max-memory"),
        )


BYTE_SIZES = ("--max-memory", "--max-load")  # sizes in bytes count in powers of 1024
LIFTABLE = ("--max-memory", "--max-params")  # limits `none` lifts


def parse_limit(text: str | int, what: str) -> int:
    """parse_size, or NO_LIMIT for `none` (the explicit way past a limit that cannot be checked)."""
    if isinstance(text, str) and text.strip().lower() in ("none", "unlimited") and what in LIFTABLE:
        return NO_LIMIT
    return parse_size(text, what)


def parse_size(text: str | int, what: str) -> int:
    """'8G', '8GiB', '512M', '100000' → an integer (K/M/G/T = powers of 1024 for bytes, of 1000 for counts; the
    binary spelling KiB/MiB/GiB/TiB says the same for bytes)."""
    if isinstance(text, int):
        value = text
    else:
        unit = r"(?:[bB]|i[bB]?)?" if what in BYTE_SIZES else r"[bB]?"
        m = re.fullmatch(rf"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?){unit}\s*", str(text))
        if not m or (m.group(2) == "" and "i" in str(text).lower()):
            lift = ", or none for no limit" if what in LIFTABLE else ""
            raise InputError(f"{what} {str(text)[:40]!r} is not a size", f"write e.g. 8G, 512M or 100000{lift}")
        base = 1024 if what in BYTE_SIZES else 1000
        value = int(float(m.group(1)) * base ** " kmgt".index((m.group(2) or " ").lower()))
    if value <= 0:
        lift = ", or none for no limit" if what in LIFTABLE else ""
        raise InputError(f"{what} must be positive", f"write e.g. 8G, 512M or 100000{lift}")
    return value


def human_bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


LIFT_MEMORY = "lift the limit explicitly with --max-memory none if you trust the model and the input shape"


def check_input_memory(gm: fx.GraphModule, input_shape: InputSpec, max_memory: int | None = None) -> str | None:
    """Before any unbounded forward: the activations the model needs at the largest batch it will run, estimated on
    the meta device, must stay under the limit (an input shape can ask for any amount of memory). A model the meta
    device cannot run at any batch (it reads numbers from its data) is measured on one real run under an allocation
    guard at the limit instead: the note returned says so (None when the estimate sized it). Nothing is checked
    when the limit was lifted (NO_LIMIT)."""
    limit = DEFAULT_MAX_MEMORY if max_memory is None else max_memory
    if limit >= NO_LIMIT:
        return None
    batch = estimate_batch(input_shape)
    note = None
    try:
        needed = activation_bytes(meta_copy(gm), input_shape, batch)
    except NoEstimate as e:
        if _runs_on_meta_at_one(meta_copy(gm), input_shape):
            raise InputError(
                f"cannot estimate the model's activation memory on an input of shape {_shown(input_shape)} at "
                f"batch {batch} before running it: {e}",
                _batch_hint(batch),
            ) from e
        got = measured_bytes(gm, input_shape, batch, limit)
        if got.failure:
            raise InputError(
                f"the model cannot run on an input of shape {_shown(input_shape)} at batch {batch}: {got.failure}",
                "give the input the model expects: --input-shape N,C,H,W, or --input NAME:DTYPE[SHAPE] per input",
            ) from e
        if got.over:
            raise InputError(
                f"the model needs more than {human_bytes(limit)} of activations on an input of shape "
                f"{_shown(input_shape)} at batch {batch} (measured on a real run: it asked for "
                f"{human_bytes(got.over)} more with {human_bytes(got.held)} held)",
                "give a smaller --input-shape, or raise the limit with --max-memory SIZE",
            ) from e
        needed, note = got.bytes, _measured_note(got.bytes, batch, e)
    if needed > limit:
        raise InputError(
            f"the model needs about {human_bytes(needed)} of activations on an input of shape "
            f"{_shown(input_shape)} at batch {batch} (limit {human_bytes(limit)})",
            "give a smaller --input-shape, or raise the limit with --max-memory SIZE",
        )
    return note


MEASURED = "activation memory measured on a real run"  # how the note of a measured model begins


def _measured_note(needed: int, batch: int, e: NoEstimate) -> str:
    return (
        f"{MEASURED} at batch {batch} under the memory limit ({human_bytes(needed)}): the meta device cannot size "
        f"it ({e})"
    )


def _runs_on_meta_at_one(gm: fx.GraphModule, input_shape: InputSpec) -> bool:
    """Whether the meta-device estimate runs at batch 1 (`gm` on the meta device): then a failure at a larger batch
    is the model's (it bakes in the batch size), not the meta device's."""
    try:
        activation_bytes(gm, input_shape, 1)
    except NoEstimate:
        return False
    return True


def _shown(spec: InputSpec) -> str:
    """As messages always showed the example input: a bare shape as (1, 3, 32, 32), named inputs as specs."""
    return str(tuple(spec[0].shape)) if is_positional(spec) else str(tuple(spec))


def _batch_hint(batch: int) -> str:
    return (
        f"it runs at batch 1, not {batch} (graphgrow runs batches up to {batch}): free the batch dimension, "
        "e.g. x.flatten(1) for x.view(1, -1); or " + LIFT_MEMORY
    )


def _measure_grown(
    name: str, grown: fx.GraphModule, input_shape: InputSpec, batch: int, limits: Limits, e: NoEstimate
) -> tuple[int, str]:
    """The grown model the meta device cannot run: refused, saying what the verifier would have, when it bakes in
    the batch size (it runs on the meta device at batch 1); otherwise measured on one real run under the memory
    limit (measured_bytes), refused when it cannot run or needs more. Its activations and the note that says so."""
    with on_meta(grown):
        at_one = _runs_on_meta_at_one(grown, input_shape)
    if at_one:
        raise ValidationError(
            f"the model {name} would make runs at batch 1 but not at batch {batch}: {e}",
            "a view/reshape probably bakes in the batch size",
        ) from e
    got = measured_bytes(grown, input_shape, batch, limits.max_memory)
    if got.failure:
        raise ValidationError(
            f"the model {name} would make cannot run at batch {batch}: {got.failure}",
            "check --input-shape or the target the pass was given",
        ) from e
    if got.over:
        raise NotApplicable(
            f"{name} would need more than {human_bytes(limits.max_memory)} of activations at batch {batch} "
            f"(measured on a real run: it asked for {human_bytes(got.over)} more with {human_bytes(got.held)} held)",
            "choose a smaller growth or input shape, or raise the limit with --max-memory SIZE",
        ) from e
    return got.bytes, _measured_note(got.bytes, batch, e)


@dataclass(frozen=True)
class PassMemory:
    """What a pass allocates beyond the model it starts from (bytes), estimated on the meta device: the grown model's
    new tensors (every one when the pass copies the model, only those it adds or rebuilds when it shares the rest),
    verification's gradient and SGD-step copy of each parameter the trainability check watches (added, grown, and
    the old ones just upstream: verify.check_trainability), and the grown model's activations
    at the largest batch run. Measured on decoder-only transformers of 125 M–1 B parameters
    (benchmarks/scale_decoder.py) the pass + verification peak stays within this, plus the input's own weights."""

    weights: int
    verification: int
    activations: int
    batch: int

    @property
    def total(self) -> int:
        return self.weights + self.verification + self.activations

    def describe(self) -> str:
        return (
            f"{human_bytes(self.activations)} of activations at batch {self.batch}, {human_bytes(self.weights)} of new "
            f"weights, {human_bytes(self.verification)} for verification's gradients"
        )


def pass_memory(
    gm: fx.GraphModule,
    grown: fx.GraphModule,
    input_shape: InputSpec,
    share: bool = False,
    activations: int | None = None,
) -> PassMemory:
    """PassMemory of `grown` made from `gm` (`activations`: already estimated on the meta device; without them
    `grown` must be a meta-device dry run's result). A parameter counts as rebuilt when its name is new
    or its shape changed (a pass that rewrites values in place of the same shape is not seen: none of the built-in
    ones does). NoEstimate when the grown model cannot run on the meta device."""
    old = {name: tuple(p.shape) for name, p in gm.named_parameters()}
    params = dict(grown.named_parameters())
    changed = sum(_nbytes(p) for name, p in params.items() if old.get(name) != tuple(p.shape))
    # what the trainability check watches: the new and grown parameters and the old ones just upstream of them (on a
    # residual stream, every writer into it before the new part), each with a gradient and an SGD-step copy
    grew = new_parameters(gm, grown)
    watched = sum(_nbytes(params[n]) for n in set(grew) | set(upstream_parameters(gm, grown, grew)))
    buffers = sum(_nbytes(b) for b in grown.buffers())  # always copies (train-mode forwards write BatchNorm statistics)
    weights = (changed if share else sum(_nbytes(p) for p in params.values())) + buffers
    batch = estimate_batch(input_shape)
    if activations is None:
        activations = activation_bytes(grown, input_shape, batch)
    return PassMemory(weights, 2 * watched, activations, batch)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def pass_allocations(name: str, limits: Limits):
    """The pass runs for real within: under an AllocationGuard at `limits.max_memory` (what it may hold beyond the
    model it starts from), whose refusal becomes NotApplicable, even when the pass caught it or raised another error
    on its way out. Nothing is guarded when the limit was lifted (NO_LIMIT)."""
    if limits.max_memory >= NO_LIMIT:
        yield
        return
    guard = AllocationGuard(limits.max_memory)
    try:
        with guard:
            yield
    except BaseException as e:
        if guard.refusal is None:
            raise
        raise _over_limit(name, limits, guard) from e
    if guard.refusal is not None:
        raise _over_limit(name, limits, guard) from guard.refusal


def _over_limit(name: str, limits: Limits, guard: AllocationGuard) -> NotApplicable:
    needed, held = getattr(guard.refusal, "needed", 0), getattr(guard.refusal, "held", 0)
    return NotApplicable(
        f"{name} would hold more than {human_bytes(limits.max_memory)} beyond the model's own weights "
        f"while it runs (it asked for {human_bytes(needed)} more with {human_bytes(held)} held)",
        "choose a smaller growth, or raise the limit with --max-memory SIZE",
    )


@contextlib.contextmanager
def on_meta(gm: nn.Module):
    """Within it, `gm`'s parameters, buffers and plain tensor attributes are meta tensors of the same shapes (no
    copy of the model, for a size estimate); the originals are put back on the way out."""
    saved: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for m in gm.modules():
            stores: tuple[dict, dict] = (m._parameters, m._buffers)
            for store in stores:
                for key, t in list(store.items()):
                    if t is not None:
                        saved.append((store, key, t))
                        meta = torch.empty_like(t, device="meta")
                        store[key] = (
                            nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
                        )
            for key, t in list(vars(m).items()):
                if isinstance(t, torch.Tensor):
                    saved.append((m.__dict__, key, t))
                    m.__dict__[key] = torch.empty_like(t, device="meta")
        yield gm
    finally:
        for store, key, t in reversed(saved):
            store[key] = t


def check_grown(
    name: str, gm: fx.GraphModule, grown: fx.GraphModule, input_shape: InputSpec, limits: Limits, share: bool = False
) -> str | None:
    """Before verification runs `grown` (what `name` made from `gm`): NotApplicable past the limits — parameters
    added, or PassMemory.total (new weights, verification's gradients and activations); ValidationError when the
    grown model cannot run at the estimate's batch. Nothing is sized when the memory limit was lifted (NO_LIMIT).
    A grown model the meta device cannot run is measured on a real run (_measure_grown): the note returned says so."""
    added = sum(p.numel() for p in grown.parameters()) - sum(p.numel() for p in gm.parameters())
    if added > limits.max_new_params:
        raise NotApplicable(
            f"{name} would add {added:,} parameters (limit {limits.max_new_params:,})",
            "choose a smaller growth, or raise the limit with --max-params N",
        )
    if limits.max_memory >= NO_LIMIT:
        return None
    batch = estimate_batch(input_shape)
    note = None
    try:
        with on_meta(grown):
            activations = activation_bytes(grown, input_shape, batch)
    except NoEstimate as e:
        activations, note = _measure_grown(name, grown, input_shape, batch, limits, e)
    needed = pass_memory(gm, grown, input_shape, share, activations)
    if needed.total > limits.max_memory:
        raise NotApplicable(
            f"{name} would need about {human_bytes(needed.total)} beyond the model's own weights "
            f"({needed.describe()}; limit {human_bytes(limits.max_memory)})",
            "choose a smaller growth or input shape, or raise the limit with --max-memory SIZE",
        )
    return note


# Peak memory of the ONNX stages beyond the model's own weights, per byte of them (measured on the 125 M–1 B
# decoders of benchmarks/scale_decoder.py, docs/performance.md): a self-contained file holds the protobuf, its bytes
# and the checker's copy (up to 5.0×); with external data the weights stream to the data file (1.1×); onnxruntime's
# session and the check beside PyTorch (2.3×). Fixed costs (torch.export itself, a few hundred MiB) are not counted.
EXPORT_PEAK = {False: 5.0, True: 1.1}
CHECK_PEAK = 2.3


def check_onnx_memory(gm: nn.Module, external: bool | None, check: bool, max_memory: int | None = None) -> None:
    """Before an ONNX export (`external`: how it writes the weights; None: no export) and an onnxruntime check of it:
    InputError when either stage would need more than `max_memory` (None: the default, 8G) beyond the model's
    weights, by the measured factors above."""
    limit = DEFAULT_MAX_MEMORY if max_memory is None else max_memory
    if limit >= NO_LIMIT:
        return
    weights = state_bytes(gm)
    stages = (
        [(f"exporting it to ONNX ({'with external data' if external else 'one file'})", EXPORT_PEAK[external])]
        if external is not None
        else []
    ) + ([("checking it in onnxruntime", CHECK_PEAK)] if check else [])
    for what, factor in stages:
        needed = int(factor * weights)
        if needed > limit:
            hint = "raise the limit with --max-memory SIZE"
            if factor == EXPORT_PEAK[False]:
                hint = (
                    f"export with external data (graphgrow export --external-data: about {EXPORT_PEAK[True]}× the "
                    "weights, streamed to NAME.onnx.data), or " + hint
                )
            raise InputError(
                f"{what} would need about {human_bytes(needed)} beyond the model's {human_bytes(weights)} of "
                f"weights ({factor}× them; limit {human_bytes(limit)})",
                hint,
            )


def check_session_memory(declared: int, max_memory: int | None = None) -> None:
    """Before an onnxruntime session is made from a file graphgrow did not just write: its `declared` tensor bytes
    (onnx_external.declared_bytes) by the check's measured factor must stay under `max_memory` (None:
    the default, 8G). Sized from the file, not from the PyTorch model it is compared with: the two may differ."""
    limit = DEFAULT_MAX_MEMORY if max_memory is None else max_memory
    needed = int(CHECK_PEAK * declared)
    if limit < NO_LIMIT and needed > limit:
        raise InputError(
            f"checking it in onnxruntime would need about {human_bytes(needed)} for the ONNX file's "
            f"{human_bytes(declared)} of declared tensors ({CHECK_PEAK}× them; limit {human_bytes(limit)})",
            "raise the limit with --max-memory SIZE",
        )


def estimate_pass(
    apply: Callable[[fx.GraphModule], fx.GraphModule], gm: fx.GraphModule, input_shape: InputSpec, share: bool = False
) -> PassMemory:
    """PassMemory of one pass before it runs (`apply` runs on a meta copy of `gm`): what check_grown will find, for
    planning (the scale benchmark prints it beside the measured peaks)."""
    if any("gg_shape" not in n.meta for n in gm.graph.nodes):
        annotate(gm, input_shape)  # as Pass.__call__ does first: passes find their places from the shapes
    return pass_memory(gm, apply(meta_copy(gm)), input_shape, share)
