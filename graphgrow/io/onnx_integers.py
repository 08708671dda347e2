"""Integer powers and sums, for ONNX export: onnxruntime computes them in double precision, PyTorch exactly.

onnxruntime's CPU kernels for Pow and ReduceSum (and ReduceProd) on int64 tensors go through `double` (measured,
onnxruntime 1.2x): a result past 2^53 loses its low bits (1000000007² = 1000000014000000049 comes back as
…000000000) and one past the type's range saturates, where PyTorch's integer arithmetic is exact and wraps around
modulo 2^64. A hash written as integer arithmetic (a rolling polynomial hash, Σ tokenᵢ·primeⁱ, then `% buckets`)
therefore picks other buckets in onnxruntime than in PyTorch: HF BLT's byte-group hash embeddings differed by 5.3 in
its logits. Mul, Add, Sub, CumSum, Mod and MatMul on int64 are exact and wrap as PyTorch does (measured), so
`exact_integers` rewrites a copy of the graph before export:

- an integer power becomes multiplications: a constant exponent by squaring (x³ = x·x·x), a tensor exponent as the
  product over its bits of the squares base^(2^k) that a bit selects, as many bits as the exponent's type holds
  (fewer where the exponent is the same on every run: computed from no input, deterministic), and PyTorch's rule for
  negative exponents (0, except for a base of ±1);
- an integer sum becomes a cumulative sum read at its last element (a zero prepended: an empty sum is 0).

Floating-point powers and sums are left as they are. The equivalence check compares the exported model with the
original graph, so the rewrite is checked on every export.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx

from ..core.state import training_mode
from ..graph import ops
from ..graph.inputs import ExampleInput, positional
from ..graph.shapes import example_input, run_recording

POWERS = ops.POWERS
SUMS = ops.SUMS


def int_pow(base: Any, exponent: Any, *, dtype: torch.dtype, bits: int) -> torch.Tensor:
    """base ** exponent in the integer `dtype`, from multiplications only (exact, wrapping as PyTorch's does).
    `bits`: how many of a tensor exponent's low bits can be set."""
    if not isinstance(exponent, torch.Tensor):  # a constant exponent (≥ 0: PyTorch refuses a negative one)
        b, result, e = base.to(dtype), None, int(exponent)
        while e:
            if e & 1:
                result = b if result is None else result * b
            e >>= 1
            if e:
                b = b * b
        return torch.ones_like(base, dtype=dtype) if result is None else result
    b0 = base.to(dtype) if isinstance(base, torch.Tensor) else torch.full_like(exponent, base, dtype=dtype)
    b0, e = torch.broadcast_tensors(b0, exponent)
    mag = e.abs() if e.dtype.is_signed else e
    result, b = torch.ones_like(b0), b0
    for k in range(bits):
        if k:
            b = b * b
        result = torch.where(torch.remainder(mag, 2) == 1, result * b, result)
        mag = torch.div(mag, 2, rounding_mode="trunc")
    if e.dtype.is_signed:  # b ** -n: 1 for b = 1, ±1 for b = -1, else 0 (PyTorch's integer rule)
        result = torch.where((e < 0) & (b0.abs() != 1), torch.zeros_like(result), result)
    return result


def int_sum(x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: torch.dtype) -> torch.Tensor:
    """torch.sum(x, dim, keepdim) in the integer `dtype` as a cumulative sum's last element (exact in onnxruntime)."""
    x = x.to(dtype)
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        total = torch.cat([x.new_zeros(1), x.reshape(-1)]).cumsum(0)[-1]
        return total.reshape([1] * x.dim()) if keepdim else total
    if x.dim() == 0:
        return x
    dims = sorted({d % x.dim() for d in (dim if isinstance(dim, (list, tuple)) else [dim])})
    for d in dims:
        shape = list(x.shape)
        shape[d] = 1
        x = torch.cat([x.new_zeros(shape), x], d).cumsum(d)
        x = x.narrow(d, x.shape[d] - 1, 1)
    return x if keepdim else x.squeeze(tuple(dims))


def exact_integers(gm: torch.nn.Module, input_shape: ExampleInput) -> torch.nn.Module:
    """`gm` itself when its graph holds no integer power or sum, else a GraphModule sharing its modules and
    parameters whose integer powers and sums are int_pow and int_sum. Dtypes come from the nodes' metadata, or
    from one run on the example input where a node has none."""
    if not isinstance(gm, fx.GraphModule):
        return gm
    found = [n for n in gm.graph.nodes if _name(n) in POWERS | SUMS and n.op in ("call_function", "call_method")]
    if not found:
        return gm
    dtypes = _dtypes(gm, found, input_shape)
    fixed = _fixed_exponents(gm, found, input_shape)
    graph = copy.deepcopy(gm.graph)
    mapping = {n.name: n for n in graph.nodes}
    changed = False
    for old in found:
        dtype = dtypes.get(old.name)
        if dtype is None or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            continue
        n = mapping[old.name]
        call = _power(n, dtype, fixed) if _name(n) in POWERS else _sum(n, dtype)
        if call is None:
            continue
        fn, args, kwargs = call
        with graph.inserting_before(n):
            new = graph.call_function(fn, args, kwargs)
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        changed = True
    if not changed:
        return gm
    graph.lint()
    return fx.GraphModule(gm, graph)


def _name(n: fx.Node) -> str:
    t = n.target
    packet = getattr(t, "overloadpacket", None)  # an ATen overload (torch.export's graphs): its op's name
    return packet.__name__ if packet is not None else ops.op_name(t)


def _dtypes(gm: fx.GraphModule, nodes: list[fx.Node], input_shape: ExampleInput) -> dict[str, torch.dtype | None]:
    known = {n.name: _meta_dtype(n) for n in nodes}
    if all(isinstance(d, torch.dtype) for d in known.values()):
        return known
    with training_mode(gm, False):
        return dict(run_recording(gm, example_input(gm, input_shape, seed=0, batch=2)).dtypes)


def _meta_dtype(n: fx.Node) -> torch.dtype | None:
    for value in (n.meta.get("gg_dtype"), n.meta.get("val"), n.meta.get("tensor_meta")):
        dtype = value if isinstance(value, torch.dtype) else getattr(value, "dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return None


def _operands(n: fx.Node, names: tuple[str, ...]) -> list[Any] | None:
    """The node's operands in the order `names` gives them (positional, then by keyword); None for any other
    keyword (an `out=`), or for a missing operand."""
    if set(n.kwargs) - set(names) - {"input", "self"}:
        return None
    values = list(n.args)
    for i, key in enumerate(names):
        if i < len(values):
            continue
        aliases = ("input", "self", key) if i == 0 else (key,)
        present = [a for a in aliases if a in n.kwargs]
        values.append(n.kwargs[present[0]] if present else _MISSING)
    return values


_MISSING = object()
_Call = tuple[Any, tuple[Any, ...], dict[str, Any]]  # a function, its arguments and keywords


def _power(n: fx.Node, dtype: torch.dtype, fixed: dict[str, torch.Tensor]) -> _Call | None:
    got = _operands(n, ("base", "exponent"))
    if got is None or len(got) != 2 or _MISSING in got:
        return None
    base, exponent = got
    if isinstance(exponent, bool) or not isinstance(exponent, (int, fx.Node)):
        return None
    if isinstance(exponent, int):
        return (int_pow, (base, exponent), {"dtype": dtype, "bits": 0}) if exponent >= 0 else None
    return int_pow, (base, exponent), {"dtype": dtype, "bits": _bits(exponent, fixed.get(exponent.name))}


def _bits(exponent: fx.Node, fixed: torch.Tensor | None) -> int:
    """How many low bits of the exponent can be set: those of its largest value where it is the same on every run,
    else all its type holds."""
    if fixed is not None:
        return int(fixed.abs().max().item()).bit_length() if fixed.numel() else 0
    dtype = _meta_dtype(exponent) or torch.int64
    return torch.iinfo(dtype).bits - (1 if dtype.is_signed else 0)


def _fixed_exponents(gm: fx.GraphModule, found: list[fx.Node], input_shape: ExampleInput) -> dict[str, torch.Tensor]:
    """The tensor exponents that are the same on every run: no input's values or sizes reach them, and two runs on
    different inputs agree (nothing random), by name."""
    exponents = [got[1] for got in (_operands(n, ("base", "exponent")) for n in found if _name(n) in POWERS) if got]
    candidates = {e.name for e in exponents if isinstance(e, fx.Node) and _input_free(e)}
    if not candidates:
        return {}
    runs: list[dict[str, Any]] = []
    with training_mode(gm, False), torch.no_grad():
        for seed in (0, 1):
            seen: dict[str, Any] = {}
            _Keep(gm, candidates, seen).run(*positional(example_input(gm, input_shape, seed=seed, batch=2)))
            runs.append(seen)
    first, second = runs
    return {
        k: v
        for k, v in first.items()
        if isinstance(v, torch.Tensor) and not v.is_floating_point() and torch.equal(v, second.get(k))
    }


class _Keep(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, names: set[str], seen: dict[str, Any]) -> None:
        super().__init__(gm)
        self.names, self.seen = names, seen

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.names:
            self.seen[n.name] = out
        return out


def _input_free(node: fx.Node) -> bool:
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n.op == "placeholder":
            return False
        seen.add(n)
        if not _reads_no_value(n):
            todo.extend(n.all_input_nodes)
    return True


def _reads_no_value(n: fx.Node) -> bool:
    """x.device or x.dtype: what the tensor is, not what it holds or how large it is (a shape is an input's)."""
    return n.target is getattr and len(n.args) == 2 and n.args[1] in ops.TENSOR_ATTRIBUTES - {"shape"}


def _sum(n: fx.Node, dtype: torch.dtype) -> _Call | None:
    kwargs = {("dim" if k == "axis" else k): v for k, v in n.kwargs.items()}
    if set(kwargs) - {"input", "self", "dim", "keepdim", "dtype"} or not n.args:
        return None
    x, rest = n.args[0], list(n.args[1:])
    if len(rest) == 1 and isinstance(rest[0], torch.dtype):  # torch.sum(x, torch.int64)
        rest = []
    dim = rest[0] if rest else kwargs.get("dim")
    keepdim = rest[1] if len(rest) > 1 else kwargs.get("keepdim", False)
    if len(rest) > 2 or not isinstance(keepdim, bool) or not _is_dims(dim):
        return None
    return int_sum, (x, dim, keepdim), {"dtype": dtype}


def _is_dims(dim: Any) -> bool:
    if dim is None or (isinstance(dim, int) and not isinstance(dim, bool)):
        return True
    return isinstance(dim, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in dim)
