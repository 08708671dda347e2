"""The op vocabulary: which fx ops read only a shape, which only change a view, which act elementwise, which reduce.

Every analysis (coupling, axes, stream, head layout, budget, mode merging) classifies nodes with these sets instead of
keeping its own table. Names are the `target` of a `call_method` node (`x.view(…)` → "view") or the `__name__` of a
`call_function` target (operator.add → "add"); the `*_FUNCTIONS` sets hold the function objects themselves.
An analysis that follows fewer ops than a class names derives its set from these with a comment saying why
(tests/test_architecture.py keeps op-name tables out of every other module).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

# --- shape facts: read a tensor's metadata, produce no tensor (a growth changes the number, never a value) ---------
SHAPE_METHODS = frozenset({"size", "dim", "numel"})  # called: x.size(), x.dim(), x.numel()
TENSOR_ATTRIBUTES = frozenset({"shape", "dtype", "device"})  # read by getattr: x.shape (fx: getattr(x, "shape"))
SHAPE_QUERIES = SHAPE_METHODS | TENSOR_ATTRIBUTES

# --- same values, same shape: one data operand, only the dtype, device or storage may change -----------------------
CASTS = frozenset({"float", "to", "type_as"})  # type_as's second operand gives a dtype, not data
COPIES = frozenset({"contiguous", "clone"})
SAME_VALUES = CASTS | COPIES

# --- views and reshapes: the same data in another shape ------------------------------------------------------------
RESHAPES = frozenset({"reshape", "view"})  # a new shape written as sizes: literal sizes may name a grown width
RESHAPES_AS = frozenset({"reshape_as", "view_as"})  # the new shape read from another tensor
FLATTENS = frozenset({"flatten", "unflatten"})  # merge or split adjacent dims
TRANSPOSES = frozenset({"transpose", "permute"})  # reorder dims, every element kept
UNIT_DIMS = frozenset({"squeeze", "unsqueeze"})  # drop or add a size-1 dim
BROADCASTS = frozenset({"expand", "expand_as"})  # repeat size-1 dims without copying
SPLITS = frozenset({"split", "chunk", "unbind"})  # one tensor into a tuple of pieces along a dim
SHAPE_DONORS = frozenset({"type_as", "expand_as", "view_as", "reshape_as"})  # x.op(y): y gives a dtype or shape
INDEXING = frozenset({"select", "getitem"})  # x.select(d, i), x[i]: one index along a dim (the dim disappears)
LOOKUPS = frozenset({"embedding"})  # F.embedding(ids, table): rows of the table (its second operand) by index
# entries of a tensor (the first operand) picked along one dim by a tensor of integer indices: x.index_select(d, idx),
# x.gather(d, idx) (x[idx], a getitem with a tensor in its index, is INDEXING's getitem)
TABLE_READS = frozenset({"index_select", "gather"})
# values read out of the data as Python numbers, or tensors whose size depends on the values: what is sized from them
# (a mixture of experts' per-expert split, `.tolist()` of its routing counts) changes from input to input
DATA_READS = frozenset({"item", "tolist", "_local_scalar_dense", "nonzero", "argwhere", "unique", "bincount"})

# ops whose result may share storage with their input (a view in torch's sense: writing one writes the other)
MAY_ALIAS = (
    RESHAPES
    | FLATTENS
    | TRANSPOSES
    | UNIT_DIMS
    | BROADCASTS
    | SPLITS
    | INDEXING
    | frozenset(
        {
            "t",
            "movedim",
            "swapaxes",
            "view_as",  # more reorderings and reshapes
            "narrow",
            "diagonal",
            "unfold",
            "as_strided",  # parts of the input
            "contiguous",  # returns its input itself when it is contiguous already
            "detach",
            "real",
            "imag",  # the same storage under another autograd node / dtype
        }
    )
)

# --- elementwise ---------------------------------------------------------------------------------------------------
# unary: output element i depends on input element i only
UNARY_METHODS = frozenset({"relu", "sigmoid", "tanh", "exp", "abs", "neg"})
# one tensor's values limited to bounds: unary where the bounds are numbers (Swin V2's clamp(logit_scale, max=…))
BOUNDS = frozenset({"clamp", "clamp_min", "clamp_max", "clip"})
# binary arithmetic, broadcast: names as fx shows them (operator.truediv → "truediv", operator.iadd → "iadd")
BINARY_NAMES = frozenset({"add", "sub", "mul", "div", "truediv"})
IN_PLACE_OPERATORS = frozenset({"iadd", "imul"})  # x += y, x *= y traced as operator.iadd / operator.imul
SELECTS = frozenset({"where"})  # torch.where(cond, x, y): each output element one of its operands' elements
TILES = frozenset({"repeat"})  # x.repeat(n0, n1, …): the tensor tiled n_i times along dim i (the copies outermost)
SUM_FUNCTIONS = frozenset({operator.add, torch.add})  # x + y
DIFFERENCE_FUNCTIONS = frozenset({operator.sub, torch.sub})  # x - y
ADD_FUNCTIONS = SUM_FUNCTIONS | DIFFERENCE_FUNCTIONS  # x ± y
PRODUCT_FUNCTIONS = frozenset({operator.mul, torch.mul})  # x · y
MUL_FUNCTIONS = PRODUCT_FUNCTIONS | frozenset({operator.truediv, torch.div})  # x · y, x / y
BINARY_FUNCTIONS = ADD_FUNCTIONS | MUL_FUNCTIONS | frozenset({operator.iadd, operator.imul})

# --- reductions ----------------------------------------------------------------------------------------------------
LINEAR_REDUCTIONS = frozenset({"sum", "mean"})  # linear in the input: a zero coordinate adds nothing
MOMENTS = frozenset({"mean", "var", "std", "var_mean", "std_mean"})  # statistics over the reduced dims
REDUCTIONS = LINEAR_REDUCTIONS | MOMENTS
EXTREMA = frozenset({"amax", "amin", "max", "min"})  # the largest or smallest over the reduced dims
VECTOR_NORMS = frozenset({"norm", "linalg_vector_norm", "vector_norm"})  # ‖x‖ over the reduced dims
# every op that combines the elements along the dims it reduces: each result mixes all of them
MIXING_REDUCTIONS = REDUCTIONS | EXTREMA | VECTOR_NORMS | frozenset({"logsumexp", "prod"})

# --- integer arithmetic that onnxruntime computes in double precision (io/onnx_integers: rewritten exactly) ---------
POWERS = frozenset({"pow"})  # x ** y, torch.pow(x, y), x.pow(y); ATen's pow.Tensor_Scalar / Tensor_Tensor / Scalar
SUMS = frozenset({"sum"})  # torch.sum(x, dim), x.sum(); ATen's sum.default / sum.dim_IntList

# --- normalisations: statistics over the last dims, then an affine (named as functions or methods) ------------------
NORMS = frozenset({"layer_norm", "rms_norm"})
SOFTMAX_FUNCTIONS = frozenset({F.softmax, F.log_softmax, torch.softmax, torch.log_softmax})  # normalise along one dim


def op_name(target: object) -> str:
    """The vocabulary name of a node's target: a method name as is, a function by its __name__."""
    return target if isinstance(target, str) else getattr(target, "__name__", "")


# reductions that return one tensor of statistics over the dims they are given (not max/min: those also return
# indices); a norm written out reads them (analysis.head_layout)
AXIS_STATISTICS = LINEAR_REDUCTIONS | frozenset({"var", "amax", "amin", "logsumexp"})

# --- pooling: the largest value of each channel over a window of the map (the channels first, after the batch) -----
MAX_POOLS = frozenset(
    {"max_pool1d", "max_pool2d", "max_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d"}
)
