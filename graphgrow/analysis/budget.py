"""How much a pass may add, checked before it is allocated.

A pass runs once, for real, under an allocation guard (allocation.py): the allocation that would take
what the pass holds past `--max-memory` is refused before it happens. The grown model is then sized
before anything else runs on it: the parameters it added (`--max-params`), and what verification
will allocate (its activations at the largest batch, estimated on the meta device, and the
trainability check's gradients) plus the new weights. The defaults keep a typo or a growth far too
large from allocating for minutes; raise them with `--max-params` / `--max-memory` (Python:
`Pipeline(..., limits=Limits(...))`).

Fail closed: where no estimate can be made (a grown model the meta device cannot run), the command is
refused with the reason unless the user lifted the limit explicitly (`--max-memory none`,
`--max-params none`: NO_LIMIT); nothing real is run unbounded.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.allocation import AllocationGuard
from ..core.errors import InputError, NotApplicable, ValidationError, first_line
from ..graph import ops
from ..graph.fx_edit import new_parameters, upstream_parameters
from ..graph.inputs import DTYPES, InputSpec, batch_of, is_positional
from ..graph.shapes import _target_name, annotate, shape_of, state_bytes
from ..io.mode_switch import ModeSwitch

DEFAULT_MAX_NEW_PARAMS = 100_000_000  # parameters one pass may add
DEFAULT_MAX_MEMORY = 8 << 30  # bytes of activations a model may need at the largest batch it is run at (estimate_batch)
VERIFY_BATCH = 3
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
    """'8G', '512M', '100000' → an integer (K/M/G/T = powers of 1024 for bytes, of 1000 for counts)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)[bB]?\s*", str(text))
        if not m:
            lift = ", or none for no limit" if what in LIFTABLE else ""
            raise InputError(f"{what} {str(text)[:40]!r} is not a size", f"write e.g. 8G, 512M or 100000{lift}")
        base = 1024 if what in BYTE_SIZES else 1000
        value = int(float(m.group(1)) * base ** " kmgt".index((m.group(2) or " ").lower()))
    if value <= 0:
        lift = ", or none for no limit" if what in LIFTABLE else ""
        raise InputError(f"{what} must be positive", f"write e.g. 8G, 512M or 100000{lift}")
    return value


_SAME_SHAPE = (
    nn.modules.batchnorm._NormBase,
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.SiLU,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Sigmoid,
    nn.Tanh,
    nn.LeakyReLU,
    nn.Identity,
    nn.modules.dropout._DropoutNd,
    nn.LayerNorm,
    nn.GroupNorm,
)
# the binary ops whose output shape is the broadcast of their inputs' (division left out: its meta kernel is used)
_ELEMENTWISE = ops.ADD_FUNCTIONS | ops.PRODUCT_FUNCTIONS


def _fast_shape(gm: fx.GraphModule, n: fx.Node, args: tuple) -> torch.Tensor | None:
    """The output of common layers as an empty meta tensor, from shape rules instead of the meta kernels
    (which cost about a millisecond a node); None where no rule applies."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if n.op == "call_module" and x is not None and len(args) == 1 and not n.kwargs:
        m = gm.get_submodule(n.target)  # type: ignore[arg-type]
        if isinstance(m, _SAME_SHAPE) and type(m).__module__.startswith(
            "torch.nn.modules."
        ):  # torch's own, not a subclass
            return torch.empty(x.shape, dtype=x.dtype, device="meta")
        if type(m) is nn.Conv2d and x.dim() == 4 and isinstance(m.padding, tuple):
            h, w = (
                (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
                for size, pad, dil, k, stride in zip(x.shape[2:], m.padding, m.dilation, m.kernel_size, m.stride)
            )
            return torch.empty((x.shape[0], m.out_channels, h, w), dtype=x.dtype, device="meta")
        if type(m) is nn.Linear:
            return torch.empty((*x.shape[:-1], m.out_features), dtype=x.dtype, device="meta")
    if n.op == "call_function" and n.target in _ELEMENTWISE and not n.kwargs and len(args) == 2:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors and all(isinstance(a, (torch.Tensor, int, float)) for a in args):
            shape = torch.broadcast_shapes(*(t.shape for t in tensors))
            return torch.empty(shape, dtype=tensors[0].dtype, device="meta")
    return None


def estimate_batch(input_shape: InputSpec) -> int:
    """The largest batch a command runs the model at: verification's, or the example's own when larger."""
    return max(VERIFY_BATCH, batch_of(input_shape))


class NoEstimate(Exception):
    """The meta device could not run a node, so no size could be estimated."""

    def __init__(self, node: fx.Node, shapes: list, error: BaseException):
        self.message = (
            f"node '{node.name[:80]}' ({node.op} {_target_name(node)[:80]}) fails on inputs of shapes {shapes} "
            f"on the meta device: {type(error).__name__}: {first_line(error, 200)}"
        )
        super().__init__(self.message)
        self.node, self.error = node.name, error

    def __str__(self) -> str:  # fx's Interpreter appends the graph to args[0] on the way out
        return self.message


def activation_bytes(gm: fx.GraphModule, input_shape: InputSpec, batch: int | None = None) -> int:
    """Sum of every node's output size on the meta device (an upper bound of what a forward keeps), at `batch`
    (default: estimate_batch). NoEstimate names the node the meta device cannot run."""
    b = estimate_batch(input_shape) if batch is None else batch
    dtype = next((p.dtype for p in gm.parameters() if p.is_floating_point()), torch.float32)
    specs = [(list(t.shape), DTYPES[t.dtype]) for t in input_shape]
    inputs = [
        torch.empty([b] + s[1:], device="meta", dtype=dtype if d in (None, torch.float32) else d) for s, d in specs
    ]
    # Tensors a leaf creates without naming a device are made on the meta device too.
    with torch.no_grad(), torch.device("meta"):
        return _node_bytes(gm, inputs)


def _node_bytes(gm: fx.GraphModule, inputs: Sequence, body: bool = False) -> int:
    """activation_bytes on meta `inputs`. A mode switch's bodies are graphs of their own, read from the file as data
    (a hostile one can hold any temporary): each is counted node by node and the largest adds to the switch's
    output (`body`: counting one, whose inputs and output are already counted outside)."""
    total = 0

    class Count(fx.Interpreter):
        def run_node(self, n):
            nonlocal total
            try:
                out = None
                if n.op in ("call_module", "call_function"):
                    args, kwargs = self.fetch_args_kwargs_from_env(n)
                    out = (
                        _fast_shape(gm, n, args)
                        if all(not isinstance(a, torch.Tensor) or a.is_meta for a in args)
                        else None
                    )
                if out is None:
                    out = super().run_node(n)
            except NoEstimate:
                raise
            except Exception as e:
                out = self.both_ways(n) if n.op == "call_module" else None
                if out is None:
                    raise NoEstimate(n, [shape_of(self.env.get(a)) for a in n.all_input_nodes], e) from e
            if not (body and n.op in ("placeholder", "output")):
                total += _bytes(out)
            if n.op == "call_module" and isinstance(switch := gm.get_submodule(n.target), ModeSwitch):  # type: ignore[arg-type]
                values = self.fetch_args_kwargs_from_env(n)[0][switch.conditions :]
                total += max(_node_bytes(b, values, body=True) for b in switch.bodies())
            return out

        def both_ways(self, n):
            """A leaf that branches on its data (`if x.sum() > 0:`, which fx cannot trace): run it with every such
            test answered True, then False, and keep the larger output. None when it fails for another reason
            (a number read from data, `.item()` or `int(t)`, could size anything: that stays unsized)."""
            outs = []
            for answer in (True, False):
                with _AnswerTests(answer) as mode:
                    try:
                        outs.append(super().run_node(n))
                    except Exception:
                        return None
                if not mode.asked:
                    return None
            return max(outs, key=_bytes)

    Count(gm).run(*inputs)
    return total


def _bytes(out) -> int:
    return sum(
        t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
    )


class _AnswerTests(TorchDispatchMode):
    """Answers `bool(meta tensor)` (a branch on data) with `answer`; every other read of a value still fails."""

    def __init__(self, answer: bool):
        super().__init__()
        self.answer, self.asked = answer, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta and args[0].dtype is torch.bool:
            self.asked = True
            return self.answer
        return func(*args, **(kwargs or {}))


def human_bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def meta_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with every parameter, buffer and plain tensor attribute (fx's `_tensor_constant`s) on the meta
    device, without copying their bytes."""
    memo: dict = {}
    for m in gm.modules():
        for p in m.parameters(recurse=False):
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for b in m.buffers(recurse=False):
            memo[id(b)] = torch.empty_like(b, device="meta")
        for value in vars(m).values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = torch.empty_like(value, device="meta")
    out = copy.deepcopy(gm, memo)
    out.meta = copy.deepcopy(gm.meta)  # the pass reads graphgrow's bookkeeping (input shape, log) from it
    return out


LIFT_MEMORY = "lift the limit explicitly with --max-memory none if you trust the model and the input shape"


def check_input_memory(gm: fx.GraphModule, input_shape: InputSpec, max_memory: int | None = None) -> None:
    """Before any real forward: the activations the model needs at the largest batch it will run, estimated on
    the meta device, must stay under the limit (an input shape can ask for any amount of memory). Fails closed:
    a model the meta device cannot run is refused unless the limit was lifted (NO_LIMIT)."""
    limit = DEFAULT_MAX_MEMORY if max_memory is None else max_memory
    if limit >= NO_LIMIT:
        return
    batch = estimate_batch(input_shape)
    try:
        needed = activation_bytes(meta_copy(gm), input_shape, batch)
    except NoEstimate as e:
        raise InputError(
            f"cannot estimate the model's activation memory on an input of shape {_shown(input_shape)} at "
            f"batch {batch} before running it: {e}",
            _no_estimate_hint(gm, input_shape, batch),
        ) from e
    if needed > limit:
        raise InputError(
            f"the model needs about {human_bytes(needed)} of activations on an input of shape "
            f"{_shown(input_shape)} at batch {batch} (limit {human_bytes(limit)})",
            "give a smaller --input-shape, or raise the limit with --max-memory SIZE",
        )


def _shown(spec: InputSpec) -> str:
    """As messages always showed the example input: a bare shape as (1, 3, 32, 32), named inputs as specs."""
    return str(tuple(spec[0].shape)) if is_positional(spec) else str(tuple(spec))


def _no_estimate_hint(gm: fx.GraphModule, input_shape: InputSpec, batch: int) -> str:
    """Say whether the shape or batch is the problem (it runs at batch 1) or the model needs real data."""
    try:
        activation_bytes(meta_copy(gm), input_shape, 1)
    except NoEstimate:
        return f"check --input-shape; a model that computes with real data (data-dependent ops) cannot be sized: {LIFT_MEMORY}"
    return (
        f"it runs at batch 1, not {batch} (graphgrow runs batches up to {batch}): free the batch dimension, "
        "e.g. x.flatten(1) for x.view(1, -1); or " + LIFT_MEMORY
    )


def _refuse_unsized(name: str, grown: fx.GraphModule, input_shape: InputSpec, batch: int, e: NoEstimate) -> None:
    """The grown model cannot be sized: refuse, saying what the verifier would have (the graph is broken at the
    smallest batch, or bakes in the batch size), without running it for real."""
    try:
        activation_bytes(grown, input_shape, 1)
    except NoEstimate as at_one:
        raise ValidationError(
            f"the model {name} would make cannot be sized: {at_one}",
            f"check --input-shape or the target the pass was given; {LIFT_MEMORY}",
        ) from e
    raise ValidationError(
        f"the model {name} would make runs at batch 1 but not at batch {batch}: {e}",
        "a view/reshape probably bakes in the batch size",
    ) from e


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
) -> None:
    """Before verification runs `grown` (what `name` made from `gm`): NotApplicable past the limits — parameters
    added, or PassMemory.total (new weights, verification's gradients and activations); ValidationError when the
    grown model cannot be sized on the meta device, unless the memory limit was lifted (NO_LIMIT)."""
    added = sum(p.numel() for p in grown.parameters()) - sum(p.numel() for p in gm.parameters())
    if added > limits.max_new_params:
        raise NotApplicable(
            f"{name} would add {added:,} parameters (limit {limits.max_new_params:,})",
            "choose a smaller growth, or raise the limit with --max-params N",
        )
    if limits.max_memory >= NO_LIMIT:
        return
    batch = estimate_batch(input_shape)
    try:
        with on_meta(grown):
            activations = activation_bytes(grown, input_shape, batch)
    except NoEstimate as e:
        with on_meta(grown):
            _refuse_unsized(name, grown, input_shape, batch, e)
    needed = pass_memory(gm, grown, input_shape, share, activations)
    if needed.total > limits.max_memory:
        raise NotApplicable(
            f"{name} would need about {human_bytes(needed.total)} beyond the model's own weights "
            f"({needed.describe()}; limit {human_bytes(limits.max_memory)})",
            "choose a smaller growth or input shape, or raise the limit with --max-memory SIZE",
        )


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
