"""What a graph read from a file may do: a closed, audited list (architecture.md §7, "a stored graph is code").

A graphgrow file stores its graph as data; shape propagation and every later step run
it. So before any of it runs, every node is checked against exact lists:

- call_function: exact qualified names of pure tensor functions. Never a whole module;
  never generic callables (operator.attrgetter/methodcaller/call, getattr except for a
  few tensor attributes, setattr, eval, exec, open, __import__); nothing that touches
  files (torch.from_file, torch.load/save), processes, memory by address, storages,
  or imports. Tensor constructors (torch.empty, zeros, ones, full, rand, randn and the
  `new_*` methods: drop-path masks are built so) only with sizes read from tensors or small
  constants: the product of the constant sizes is at most MAX_CONSTANT_ELEMENTS; torch.arange
  (position ids) likewise, with a constant step of at least 1 where a bound is read at run time.
- call_method: a Tensor method that is ATen's own C binding of a pure operator (aten_policy.method_refusal:
  x.triu(), x.topk(k); derived as torch functions are) or one of the few listed below; no dunder names,
  nothing that takes a callable (apply_, map_, register_hook: no ATen operator), touches storage or memory
  (set_, storage, untyped_storage, data_ptr, share_memory_, resize_) or converts out of torch.
- get_attr: a parameter, buffer or tensor attribute of the stored module tree, or a
  module's `training` flag, reached through the module tree only (no dunder parts).
- call_module: a module of the stored tree (whose classes torch.load already
  restricted to torch.nn's layers and graphgrow's own).
- constants: the decoder admits plain types only (serialize._decode).

`trust` (the CLI's --trust) is the only way past. The lists were gathered from the
graphs fx produces for torchvision's classification models, a sample of timm models and
graphgrow's passes, and those torch.export captures of Hugging Face transformers models (GPT-2,
LLaMA, BERT, ViT, BART) written as torch functions (capture/aten_table.py), and then read one by one.
ATen operators (torch.ops.aten.NAME.OVERLOAD) that capture keeps are not picked one by one: aten_policy.py
derives their list from torch's op metadata (pure tensor computations; excluded classes named with reasons), and a
torch-level function not listed here is allowed when it binds such an operator (`torch.addcmul` → aten.addcmul:
every overload pure or an out= form, none a factory; a stored call passing out= is refused). torch.nn.functional's
layers are derived too (functional_names: the functions its public names hold, except one that takes a callable).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

from torch import fx, nn

from ..core.errors import LoadError, escape_controls
from ..core.names import is_segment
from . import aten_policy

CONSTRUCTORS = ("empty", "zeros", "ones", "full", "rand", "randn")  # torch.NAME(*sizes or sizes, ...)
NEW_METHODS = ("new_zeros", "new_ones", "new_empty", "new_full")  # x.NAME(sizes, ...)
MAX_CONSTANT_ELEMENTS = 1 << 24  # a size from a file's constants may not ask for more (a memory bomb)

# fmt: off
ALLOWED_FUNCTIONS: frozenset[str] = frozenset({
    # Python operators on tensors, shapes and numbers
    *(f"operator.{n}" for n in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "matmul", "getitem",
        "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "invert", "not_", "iadd", "isub", "imul",
        "itruediv", "ifloordiv", "imatmul")),
    "builtins.getattr",  # only with a name from TENSOR_ATTRIBUTES (checked per node)
    "builtins.len", "builtins.int", "builtins.float",
    *(f"math.{n}" for n in ("sqrt", "ceil", "floor", "log", "exp", "isqrt")),
    "math.prod",  # a product of sizes (timm Hiera: math.prod(shape)); any size made from it is bounded where used
    # torch tensor functions
    *(f"torch.{n}" for n in (
        "cat", "concat", "stack", "hstack", "vstack", "flatten", "unflatten", "permute", "transpose", "swapaxes",
        "chunk", "split", "tensor_split", "unbind", "reshape", "squeeze", "unsqueeze", "narrow", "select",
        "index_select", "gather", "roll", "flip", "movedim", "relu", "relu_", "sigmoid", "tanh", "exp", "log", "sqrt",
        "rsqrt", "abs", "neg", "erf", "sign", "clamp", "clip", "maximum", "minimum", "where", "add", "sub", "mul",
        "div", "true_divide", "matmul", "bmm", "mm", "baddbmm", "addmm", "einsum", "mean", "sum", "amax", "amin",
        "max", "min", "std", "var", "norm", "softmax", "log_softmax", "cumsum", "argmax", "topk", "masked_fill",
        "zeros_like", "ones_like", "full_like", "layer_norm", "group_norm", "batch_norm", "conv1d", "conv2d",
        "conv3d", "avg_pool1d", "adaptive_avg_pool1d", "max_pool1d", "max_pool2d", "pow", "square", "sin", "cos",
        "_assert", "broadcast_to", "expand_copy", "tile", "repeat_interleave", "pixel_shuffle", "pixel_unshuffle",
        "channel_shuffle", "rand_like", "randn_like", "bernoulli", *CONSTRUCTORS,
        # what torch.export captures of Hugging Face models (capture/aten_table.py); pure, reviewed one by one:
        # arange: position ids (sizes bounded like the constructors', check_sizes); diff: differences along a
        # dimension (its order is clamped to the size); tril/triu: causal masks (a copy, no view)
        "arange", "diff", "tril", "triu",
        # torch's symbolic-size arithmetic, as export writes sizes it reasons about (a window cut to the sequence:
        # sym_min(seq_len, window)): min, max, not, casts, a conditional and a sum of plain numbers
        "sym_min", "sym_max", "sym_not", "sym_float", "sym_int", "sym_ite", "sym_sum")),
    "torch.functional.einsum", "torch.functional.split", "torch.functional.norm",
    "torch.functional.broadcast_tensors", "torch.fx._symbolic_trace._assert_is_none",
    # torch.functional's Python wrappers whose ATen operators have other names (unique: _unique2, unique_dim;
    # a result no larger than the input); broadcast_shapes and unravel_index compute on sizes and indices
    "torch.functional.unique", "torch.functional.unique_consecutive", "torch.functional.unravel_index",
    "torch.functional.broadcast_shapes",
    # torch.nn.functional (pure layers)
    *(f"torch.nn.functional.{n}" for n in (
        "relu", "relu6", "gelu", "silu", "mish", "hardswish", "hardsigmoid", "hardtanh", "leaky_relu", "elu", "selu",
        "celu", "softplus", "sigmoid", "tanh", "softmax", "log_softmax", "dropout", "dropout1d", "dropout2d",
        "dropout3d", "layer_norm", "group_norm", "batch_norm", "instance_norm", "normalize", "linear", "conv1d",
        "conv2d", "conv3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
        "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
        "adaptive_max_pool2d", "interpolate", "pad", "scaled_dot_product_attention", "pixel_shuffle", "glu",
        "embedding")),  # an index lookup in a weight tensor (export's form of an Embedding subclass's forward)
    *(f"torch._C._nn.{n}" for n in (
        "gelu", "silu", "mish", "hardswish", "hardsigmoid", "hardtanh", "leaky_relu", "elu", "softplus", "linear",
        "avg_pool2d", "avg_pool3d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "scaled_dot_product_attention",
        "pad", "upsample_nearest2d", "upsample_bilinear2d", "relu6", "log_sigmoid")),
    # torchvision's traced helpers (installed code, pure)
    "torchvision.ops.stochastic_depth.stochastic_depth",
    "torchvision.models.googlenet.GoogLeNetOutputs", "torchvision.models.inception.InceptionOutputs",
    "torchvision.models.swin_transformer._get_relative_position_bias",
    "torchvision.models.swin_transformer._patch_merging_pad",
    "torchvision.models.swin_transformer.shifted_window_attention",
})

# Tensor methods are derived like torch functions (aten_policy.method_refusal: ATen's own C binding of a pure
# operator, `x.triu()`, `x.topk(k)`, `x.repeat_interleave(2)`); listed here only those ATen cannot vouch for:
# dtype and device conversions (bindings of `to`, no operator of their name; x.type(dtype) too), size queries with
# no operator (nelement is numel, ndimension is dim), torch.Tensor's Python wrappers of pure ops (unique),
# a tensor from the file's own constants or a copy of a tensor (new_tensor: its data is plain data in the file,
# bounded by it), and in-place forms whose functional op has another overload name (transpose_ of transpose.int,
# normal_)
ALLOWED_METHODS: frozenset[str] = frozenset({
    "float", "half", "double", "bfloat16", "bool", "long", "int", "byte", "char", "short", "cfloat", "cdouble",
    "type", "cpu", "cuda", "nelement", "ndimension", "element_size", "dim_order",
    "split", "unflatten", "norm", "unique", "unique_consecutive", "new_tensor",
    "transpose_", "normal_",
})

TENSOR_ATTRIBUTES: frozenset[str] = frozenset(
    {"shape", "dtype", "device", "ndim", "T", "mT", "real", "imag", "is_cuda",
     "values", "indices"}  # the fields of what max, min, topk, sort, median, mode, kthvalue return (a named tuple)
)
# fmt: on


def _refuse(node: str, what: str) -> LoadError:
    # `node` and `what` quote the file: control characters escaped, so the message stays one line
    return LoadError(
        escape_controls(
            f"the model graph (node '{node}') {what}, which is not on graphgrow's closed list of safe operations; "
            "nothing was run"
        ),
        "load it with --trust only if you wrote the file yourself",
    )


def _walk(root: nn.Module, target: Any, node: str) -> tuple[Any, str]:
    """Follow a dotted target through the module tree only; return (owner module or value, last segment)."""
    if not isinstance(target, str) or not target or len(target) > 1000:
        raise _refuse(node, f"names the target {str(target)[:80]!r}")
    parts = target.split(".")
    if any(not is_segment(p) for p in parts):  # the one rule for names from files (names.py)
        raise _refuse(node, f"names the target {target[:80]!r}")
    module = root
    for p in parts[:-1]:
        child = module._modules.get(p) if isinstance(module, nn.Module) else None
        if child is None:
            raise LoadError(
                f"the model graph (node '{node}') names '{target[:80]}', which is not in the saved model",
                "the file is corrupted; re-create it from the original model",
            )
        module = child
    return module, parts[-1]


def check_get_attr(root: nn.Module, target: Any, node: str) -> None:
    import torch

    module, last = _walk(root, target, node)
    if last == "training" and isinstance(module, nn.Module):
        return  # a module's mode flag (faithful tracing reads it at run time)
    if last in module._parameters or last in module._buffers:
        return
    if isinstance(module.__dict__.get(last), torch.Tensor):
        return
    if type(module.__dict__.get(last)) in (bool, int, float):
        return  # a plain number the forward reads at run time (a drop-path probability, a temperature)
    raise _refuse(node, f"reads the attribute '{str(target)[:80]}'")


def check_call_module(root: nn.Module, target: Any, node: str) -> None:
    module, last = _walk(root, target, node)
    if not isinstance(module._modules.get(last), nn.Module):
        raise LoadError(
            f"the model graph (node '{node}') calls module '{str(target)[:80]}', which is not in the saved model",
            "the file is corrupted; re-create it from the original model",
        )


def check_function(qualname: Any, node: str) -> None:
    if isinstance(qualname, str) and qualname.startswith(aten_policy.PREFIX):  # derived, not listed (aten_policy)
        if (why := aten_policy.refusal(qualname)) is not None:
            raise _refuse(node, why)
        return
    if not allowed_function(qualname):
        raise _refuse(node, f"calls '{str(qualname)[:120]}'")


def allowed_function(qualname: Any) -> bool:
    """A stored torch-level function may be called: listed, a binding of pure ATen operators (_derived), or one of
    torch.nn.functional's (_functional)."""
    return isinstance(qualname, str) and (qualname in ALLOWED_FUNCTIONS or _derived(qualname) or _functional(qualname))


FUNCTIONAL = "torch.nn.functional"


def _functional(qualname: str) -> bool:
    module, _, name = qualname.rpartition(".")
    return module == FUNCTIONAL and name in functional_names()


@functools.cache
def functional_names() -> frozenset[str]:
    """torch.nn.functional's layers, derived, not listed: the functional forms of torch.nn's layers are torch's own
    Python code over ATen operators, each a pure tensor computation (random ones as dropout is, sizes following the
    inputs and sized on the meta device like ATen's). The names are those the functions a public name of
    torch.nn.functional holds are stored under (F.threshold is `_threshold`, F.max_pool2d(..., return_indices=True)
    is `max_pool2d_with_indices`), where that name finds the same function again. Excluded: a function defined
    elsewhere (boolean_dispatch, handle_torch_function: the binding layer's machinery, no layer) and one that takes
    a callable (triplet_margin_with_distance_loss's distance_function: code, not data)."""
    import torch.nn.functional as F

    names = set()
    for public in dir(F):
        f = getattr(F, public)
        if public.startswith("_") or not inspect.isfunction(f) or f.__module__ != FUNCTIONAL:
            continue
        if getattr(F, f.__name__, None) is not f:
            continue
        if any("Callable" in str(p.annotation) for p in inspect.signature(f).parameters.values()):
            continue
        names.add(f.__name__)
    return frozenset(names)


def _passes_out(kwargs: Any) -> bool:
    """Whether an encoded keyword dict (serialize: {"dict": [[key, value], ...]}) or a plain one names `out`."""
    pairs = (
        kwargs.get("dict")
        if isinstance(kwargs, dict) and set(kwargs) == {"dict"}
        else list(kwargs.items())
        if isinstance(kwargs, dict)
        else []
    )
    # out=None is the signature's default written out (fx records torch.functional.tensordot's): it writes nothing
    return any(isinstance(p, (list, tuple)) and len(p) == 2 and p[0] == "out" and p[1] is not None for p in pairs or [])


def _derived(qualname: str) -> bool:
    """`torch.NAME` (or torch._C._nn.NAME, torch.special's, torch.linalg's, torch.fft's bindings) that binds a pure
    ATen operator (aten_policy.binding_allowed): derived, not listed."""
    module, _, name = qualname.rpartition(".")
    return module in aten_policy.BINDING_MODULES and name.isidentifier() and aten_policy.binding_allowed(name)


def check_getattr_args(args: Any, node: str) -> None:
    if not (
        isinstance(args, (list, tuple)) and len(args) == 2 and isinstance(args[1], str) and args[1] in TENSOR_ATTRIBUTES
    ):
        name = args[1] if isinstance(args, (list, tuple)) and len(args) > 1 else "?"
        raise _refuse(node, f"reads the attribute {str(name)[:80]!r} with getattr")


def check_method(name: Any, node: str) -> None:
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("__"):
        raise _refuse(node, f"calls the method '{str(name)[:80]}'")
    if name not in ALLOWED_METHODS and (why := aten_policy.method_refusal(name)) is not None:
        raise _refuse(node, why)


def allowed_method(name: Any) -> bool:
    """A stored Tensor method may be called: listed, or ATen's binding of a pure operator (derived)."""
    return (
        isinstance(name, str)
        and name.isidentifier()
        and not name.startswith("__")
        and (name in ALLOWED_METHODS or aten_policy.method_refusal(name) is None)
    )


def check_node_record(rec: Any, root: nn.Module) -> None:
    """Check one stored node record ({name, op, target, ...}) before it becomes part of a graph."""
    if not isinstance(rec, dict):
        raise LoadError("the saved graph holds a node that is not a record", "the file is corrupted")
    name = str(rec.get("name"))[:80]
    op, target = rec.get("op"), rec.get("target")
    if op in ("placeholder", "output"):
        return
    if op == "get_attr":
        check_get_attr(root, target, name)
    elif op == "call_module":
        check_call_module(root, target, name)
    elif op == "call_function":
        check_function(target, name)
        if _passes_out(rec.get("kwargs")) and not (isinstance(target, str) and target in ALLOWED_FUNCTIONS):
            raise _refuse(name, f"calls '{str(target)[:120]}' with out=: a stored call may not write into a tensor")
    elif op == "call_method":
        check_method(target, name)
    else:
        raise _refuse(name, f"has the operation kind {str(op)[:40]!r}")


def check_sizes(qualname_or_method: str, args: Any, kwargs: Any, node: str) -> None:
    """A tensor constructor's constant sizes, multiplied, stay under MAX_CONSTANT_ELEMENTS (sizes read
    from tensors at run time are bounded by the input)."""
    name = qualname_or_method.rpartition(".")[2]
    if qualname_or_method == "torch.arange":
        return _check_arange(args, kwargs, node)
    if qualname_or_method.startswith(aten_policy.PREFIX):
        return _check_aten_sizes(qualname_or_method, args, kwargs, node)
    if name not in CONSTRUCTORS and name not in NEW_METHODS:
        return
    sizes = list(args[1:] if name in NEW_METHODS else args)
    if name in ("full", "new_full") and sizes:
        sizes = sizes[:-1]  # the fill value
    if isinstance(kwargs, dict) and "size" in kwargs:
        sizes.append(kwargs["size"])
    total, todo = 1, sizes
    while todo:
        v = todo.pop()
        if isinstance(v, (list, tuple)):
            todo.extend(v)
        elif type(v) is int:
            total *= max(v, 1)
        if total > MAX_CONSTANT_ELEMENTS:
            raise _refuse(node, f"builds a tensor of more than {MAX_CONSTANT_ELEMENTS:,} elements from constants")


def _check_arange(args: Any, kwargs: Any, node: str) -> None:
    """torch.arange(end) / (start, end[, step]): constant bounds at most MAX_CONSTANT_ELEMENTS in size and a
    constant step; where a bound is computed at run time (a sequence length) the step is at least 1, so the
    count stays within the run-time bound, as for the constructors' sizes."""
    values = dict(zip(("end",) if len(args) == 1 else ("start", "end", "step"), args))
    if isinstance(kwargs, dict):
        values.update((k, kwargs[k]) for k in ("start", "end", "step") if k in kwargs)
    for key, v in values.items():
        if isinstance(v, fx.Node) and key != "step":
            continue  # read at run time (bounded by the input, as above)
        if type(v) not in (int, float) or not math.isfinite(v) or abs(v) > MAX_CONSTANT_ELEMENTS:
            raise _refuse(
                node,
                f"calls torch.arange with the {key} {str(v)[:40]} (a constant of at most "
                f"{MAX_CONSTANT_ELEMENTS:,} expected)",
            )
    start, end, step = values.get("start", 0), values.get("end", 0), values.get("step", 1)
    if step == 0:
        raise _refuse(node, "calls torch.arange with the step 0")
    known = not isinstance(start, fx.Node) and not isinstance(end, fx.Node)
    if (known and abs(end - start) / abs(step) > MAX_CONSTANT_ELEMENTS) or (not known and abs(step) < 1):
        raise _refuse(node, f"builds a tensor of more than {MAX_CONSTANT_ELEMENTS:,} elements with torch.arange")


_ATEN_RANGES = tuple(aten_policy.PREFIX + n for n in ("arange.", "range."))


def _check_aten_sizes(qualname: str, args: Any, kwargs: Any, node: str) -> None:
    """An ATen op kept by capture: arange/range as torch.arange (their arguments come in the same order); a factory
    or a `size` argument by the elements its constants ask for (aten_policy.constant_elements)."""
    args, kwargs = tuple(args) if isinstance(args, (list, tuple)) else (), kwargs if isinstance(kwargs, dict) else {}
    if qualname.startswith(_ATEN_RANGES):
        return _check_arange(args, {k: v for k, v in kwargs.items() if k in ("start", "end", "step")}, node)
    try:
        total = aten_policy.constant_elements(qualname, args, kwargs)
    except ValueError as e:
        raise _refuse(
            node,
            f"calls the ATen operator '{qualname.removeprefix(aten_policy.PREFIX)}' with constants "
            f"that do not fit it ({e})",
        ) from e
    if total is not None and total > MAX_CONSTANT_ELEMENTS:
        raise _refuse(node, f"builds a tensor of more than {MAX_CONSTANT_ELEMENTS:,} elements from constants")
