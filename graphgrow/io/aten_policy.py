"""Which ATen operators a stored graph may call: derived from torch's own op metadata, not picked by hand.

torch.export captures ATen operators (`torch.ops.aten.NAME.OVERLOAD`); capture writes the ones it knows as
torch functions (capture/aten_table.py) and keeps the rest. A graphgrow file must be able to hold whatever
is kept, so the rule is a principle over every overload the installed torch registers:

  an ATen overload is allowed when it is a pure tensor computation — it returns a result, takes only
  tensors, numbers, shapes, dtypes, devices and option strings, and writes nothing it was given, or only
  its first argument as the in-place form (`div_`) of an allowed functional op (`div`) — and belongs to
  none of the classes below.

Each excluded class has a reason (CLASSES); a refusal names the op and its class. The classification
reads the schema (`is_mutable`, argument and return types), torch's tags (`torch.Tag.core`, `inplace_view`)
and the core ATen decomposition table (`torch._decomp.core_aten_decompositions`): a private (`_`) operator
is allowed only where ATen itself vouches for it as part of its public IR — tagged `core`, or a key of the
core decomposition table (its meaning is written down as other ATen ops). Random operators
(`torch.Tag.nondeterministic_seeded`) are allowed, as they run in training; a generator cannot be stored.

Sizes: a factory (an op with no tensor argument) builds its output from constants, so its constant sizes
are bounded like torch's constructors (graph_policy.check_sizes); every other size follows from the input
tensors and is sized on the meta device before anything runs for real (--max-memory).

The same rule covers the Python bindings of these operators: a stored `torch.NAME` (torch.special's,
torch.linalg's, torch.fft's and torch._C._nn's likewise: BINDING_MODULES) or a Tensor method `x.NAME(...)` that is
ATen's own C binding of NAME (method_refusal) is allowed when its operator's overloads are.

The table is computed once, the first time an ATen name is checked, from the installed torch: the same
torch gives the same list (tests/test_aten_policy.py fuzzes it, and round-trips allowed ops drawn from it).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

PREFIX = "torch.ops.aten."

# class → why it is excluded (said in the refusal)
CLASSES: dict[str, str] = {
    "mutating": "it writes into a tensor it is given other than as the in-place form of an allowed op (out=, a "
    "second argument, a view's metadata)",
    "no result": "it returns nothing: it exists for a side effect (printing, asserting, recording a stream)",
    "dunder": "its name is a dunder name, which no stored name may be (the op is stored by its plain name, "
    "such as bitwise_and)",
    "io": "it reads or writes a file",
    "storage": "it works on storages, explicit strides and offsets or pinned memory instead of tensor values",
    "object": "it takes an object that is not plain data (a script class, a storage, a stream)",
    "sparse": "it works on sparse layouts, which graphgrow files do not hold",
    "quantized": "it works on quantized tensors, which graphgrow files do not hold",
    "backend": "it is one backend's or transform's internal kernel (cuDNN, MKL-DNN, MPS, vmap levels, ...), not a "
    "computation of its own",
    "backward": "it is an autograd backward kernel that trusts its inputs to come from the forward (bounds unchecked)",
    "unchecked": "it skips its own argument checks ('unsafe', or a kernel known to crash or return unwritten memory "
    "on arguments it does not check)",
    "private": "it is private to ATen (a leading '_') and neither tagged core nor in the core decomposition table",
    "unknown": "the installed torch has no such ATen operator",
}

_SPARSE = re.compile(
    r"sparse|(^|_)(coo|csr|csc|bsr|bsc)(_|$)|to_dense|_nnz|crow_indices|ccol_indices|col_indices|"
    r"row_indices|^_?(indices|values|coalesce|is_coalesced|dense_dim|sparse_dim)(_copy)?$|^(smm|sspaddmm|hspmm)$"
)
_QUANTIZED = re.compile(
    r"quantiz|(^|_)q_|qscheme|fake_quant|int_repr|qparams|qint|fbgemm|prepack|_saturate_weight|"
    r"_make_per_(tensor|channel)"
)
_BACKEND = re.compile(
    r"cudnn|miopen|mkldnn|mkl_|onednn|(^|_)mps(_|$)|vulkan|nnpack|xnnpack|cufft|_cslt|metal|"
    r"nested|jagged|padded_tensor|_foreach|_fused|_efficientzerotensor|_test_|_autocast|_cummax_helper|"
    r"_cummin_helper|_has_compatible_shallow_copy_type|_debug_|_propagate_xla|_batch_dim"
)
_STORAGE = re.compile(
    r"strided|storage|resize|pin_memory|is_pinned|record_stream|data_ptr|^set_|is_set_to|_reshape_alias|"
    r"^_version$|^lift$|_make_dual|_fw_primal|_unpack_dual|_shape_as_tensor|_new_zeros_with_same_feature"
)
# overloads whose CPU kernel skips a check on its arguments, found by tests/test_aten_policy.py's round trips
# (every allowed overload run on schema-filled arguments, twice): no_stats with training=False reads the running
# statistics it lacks (the process crashes); _weight_norm_interface with a gain of the wrong shape returns memory
# it never wrote
_CRASHES = frozenset({"_native_batch_norm_legit.no_stats", "_weight_norm_interface.default"})
_FILE_ARGS = frozenset({"filename", "path", "file"})
_PLAIN_TYPES = re.compile(
    r"^(Optional\[)*(List\[)*(Optional\[)*(Tensor|int|float|bool|number|str|Device|ScalarType|"
    r"Layout|MemoryFormat|Generator|complex)\]*$"
)


@functools.cache
def _classify(op: torch._ops.OpOverload) -> str | None:
    """The class that excludes `op`, or None when it is allowed. Order matters: the most telling class first."""
    schema = op._schema
    base = schema.name.split("::")[-1]
    if base.startswith("__"):
        return "dunder"
    if any(str(a.type) == "str" and a.name in _FILE_ARGS for a in schema.arguments) or base in ("_print", "from_file"):
        return "io"
    if _STORAGE.search(base) or any(a.name == "storage_offset" for a in schema.arguments):
        return "storage"
    if schema.is_mutable or torch.Tag.inplace_view in op.tags:
        return None if _in_place_form(op) else "mutating"
    if not schema.returns:
        return "no result"
    if any(not _PLAIN_TYPES.match(str(a.type)) for a in schema.arguments) or any(
        not _PLAIN_TYPES.match(str(r.type)) for r in schema.returns
    ):
        return "object"
    if _SPARSE.search(base):
        return "sparse"
    if _QUANTIZED.search(base):
        return "quantized"
    if _BACKEND.search(base):
        return "backend"
    if base.endswith("_backward") or "_backward_" in base:
        return "backward"
    if "unsafe" in base or str(op).removeprefix("aten.") in _CRASHES:
        return "unchecked"
    if base.startswith("_") and torch.Tag.core not in op.tags and op not in _decomposed():
        return "private"
    return None


def _in_place_form(op: torch._ops.OpOverload) -> bool:
    """`NAME_.OVERLOAD` that writes only its first argument, the tensor the graph computed, with what the allowed
    functional `NAME.OVERLOAD` returns (x.div_(s) is x = div(x, s)): the fx list's add_/mul_ methods, in ATen.
    An out= form, or one that writes another argument, is not."""
    schema = op._schema
    base = schema.name.split("::")[-1]
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if not base.endswith("_") or base.endswith("__") or written != [0] or len(schema.returns) != 1:
        return False
    functional = _by_name().get(f"{base[:-1]}.{op._overloadname}")
    return functional is not None and _classify(functional) is None


@functools.cache
def _decomposed() -> frozenset[torch._ops.OpOverload]:
    from torch._decomp import core_aten_decompositions

    return frozenset(k for k in core_aten_decompositions() if isinstance(k, torch._ops.OpOverload))


def overloads() -> list[torch._ops.OpOverload]:
    """Every ATen overload the installed torch registers, in name order."""
    out = []
    for name in sorted(torch._C._dispatch_get_all_op_names()):
        if not name.startswith("aten::"):
            continue
        base, _, overload = name[len("aten::") :].partition(".")
        try:
            out.append(getattr(getattr(torch.ops.aten, base), overload or "default"))
        except (AttributeError, RuntimeError):
            continue  # registered without a Python binding
    return out


@functools.cache
def _by_name() -> dict[str, torch._ops.OpOverload]:
    return {str(op).removeprefix("aten."): op for op in overloads()}


@functools.cache
def table() -> dict[str, str | None]:
    """Qualified name (torch.ops.aten.NAME.OVERLOAD) → excluding class, or None where allowed."""
    return {PREFIX + name: _classify(op) for name, op in _by_name().items()}


def allowed() -> frozenset[str]:
    return frozenset(k for k, v in table().items() if v is None)


def refusal(qualname: str) -> str | None:
    """None when the stored ATen name may be called; else the words for the refusal (op, class, reason)."""
    cls = table().get(qualname, "unknown")
    if cls is None:
        return None
    return f"calls the ATen operator '{qualname.removeprefix(PREFIX)[:120]}' ({cls}: {CLASSES[cls]})"


@functools.cache
def binding_allowed(name: str) -> bool:
    """Whether `torch.NAME`, the Python binding of ATen's NAME, may be stored: ATen has NAME, each overload is
    allowed or excluded only for writing into an `out=` tensor (which a stored call may not pass), and none is a
    factory (a factory's sizes are bounded by graph_policy's constructor rules, which name them)."""
    overloads = [q for q in table() if q.startswith(f"{PREFIX}{name}.")]
    return (
        bool(overloads)
        and any(table()[q] is None for q in overloads)
        and all(table()[q] in (None, "mutating") and not is_factory(q) for q in overloads)
    )


# torch's Python namespaces whose functions are ATen's own bindings under ATen's names (torch.special.erf is
# torch._C._special.special_erf, F.softplus is torch._C._nn.softplus), or torch's Python wrappers of them
# (torch.functional: torch.atleast_1d is stored under that name): a stored name there is judged as its op is
BINDING_MODULES = (
    "torch",
    "torch.functional",
    "torch._C._nn",
    "torch._C._special",
    "torch._C._linalg",
    "torch._C._fft",
)


@functools.cache
def method_refusal(name: str) -> str | None:
    """None when `x.NAME(...)` may be stored as derived: the Tensor method is ATen's own C binding of NAME — not
    overridden in Python by torch.Tensor, not one of the binding layer's methods that are no operator (apply_ and
    map_ take a callable, storage, tolist, numpy) — and binding_allowed(NAME). Else the words for the refusal."""
    bound = getattr(torch._C.TensorBase, name, None)
    if type(bound).__name__ != "method_descriptor" or not any(q.startswith(f"{PREFIX}{name}.") for q in table()):
        return f"calls the method '{name[:80]}' (no ATen operator's method)"
    if getattr(torch.Tensor, name, None) is not bound:
        return f"calls the method '{name[:80]}' (torch.Tensor overrides it in Python)"
    overloads = sorted(q for q in table() if q.startswith(f"{PREFIX}{name}."))
    excluded = [q for q in overloads if table()[q] not in (None, "mutating")] or (
        overloads if all(table()[q] is not None for q in overloads) else []
    )
    if excluded:
        why = refusal(excluded[0]) or ""
        return f"calls the method '{name[:80]}' of the ATen operator {why.partition('ATen operator ')[2]}"
    return None


def is_factory(qualname: str) -> bool:
    """An allowed op with no tensor argument that returns a tensor: its sizes come from constants."""
    op = _op(qualname)
    return (
        op is not None
        and not any("Tensor" in str(a.type) for a in op._schema.arguments)
        and any("Tensor" in str(r.type) for r in op._schema.returns)
    )


def _op(qualname: str) -> torch._ops.OpOverload | None:
    if table().get(qualname, "unknown") is not None:
        return None
    base, _, overload = qualname.removeprefix(PREFIX).partition(".")
    op: torch._ops.OpOverload = getattr(getattr(torch.ops.aten, base), overload)
    return op


def schema_of(qualname: str) -> torch.FunctionSchema | None:
    op = _op(qualname)
    return op._schema if op is not None else None


def constant_elements(qualname: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """How many elements an allowed op builds from constants: a factory is run on the meta device with every
    run-time value (an fx node: a size read from a tensor, bounded by the input) taken as 1; an op with a `size`
    argument that returns a new tensor (new_zeros, ...) multiplies its constant sizes. None: no such op. Raises
    ValueError where the constants do not fit the op's schema."""
    from torch import fx
    from torch.utils._pytree import tree_map

    op = _op(qualname)
    if op is None:
        return None
    if is_factory(qualname):
        probe_args, probe_kwargs = tree_map(lambda v: 1 if isinstance(v, fx.Node) else v, (tuple(args), dict(kwargs)))
        probe_kwargs["device"] = "meta"
        try:
            out = op(*probe_args, **probe_kwargs)
        except Exception as e:  # a wrong type, a negative size: the op's own checks, on the meta device
            raise ValueError((str(e).splitlines() or [type(e).__name__])[0][:160]) from e
        return sum(
            t.numel() for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)
        )
    names = [a.name for a in op._schema.arguments]
    fresh = all(r.alias_info is None for r in op._schema.returns)
    if "size" not in names or not fresh:
        return None
    i = names.index("size")
    size = args[i] if i < len(args) else kwargs.get("size")
    total = 1
    for v in size if isinstance(size, (list, tuple)) else (size,):
        if type(v) is int:
            total *= max(v, 1)
    return total
