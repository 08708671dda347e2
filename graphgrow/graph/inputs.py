"""The example input a model is traced and checked on: an input spec, a tuple of TensorSpec (issues 22, 41).

Every input description becomes one (`input_spec`): a plain shape N,C,H,W is a one-tensor spec, float32,
marked `positional` (the model's one input, passed positionally, reported as a shape: what `--input-shape`
always meant); named inputs with their own shapes and dtypes come from text
(`input_ids:1x16:int64,attention_mask:1x16:int64`) or from Python (TensorSpecs, a dict of name → TensorSpec,
shape, (shape, dtype) or an example tensor, example tensors). Example inputs for a spec are a dict name → tensor, drawn
seeded: floats standard normal; integers in [0, high) — `high` from the spec, else 2 for a
`*mask` or `token_type_ids` input (masks are all ones: every position attends), else the vocabulary of
the model's first nn.Embedding; a spec's `last` is the id every example ends with (an end-of-sequence token).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..core.errors import InputError
from ..core.names import is_identifier
from ..core.state import module_device, module_dtype

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
    "int": torch.int32,
    "bool": torch.bool,
}
MAX_INPUTS = 16


@dataclass(frozen=True)
class TensorSpec:
    """One named model input: its example shape (batch first), dtype name and, for integers, the exclusive upper
    bound."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    high: int | None = None
    dynamic: tuple[tuple[int, str], ...] = ()  # (dim, name) the user declared dynamic (`seq=128`); batch always is
    positional: bool = False  # given as a bare shape: the model's one input, passed positionally, shown as a shape
    # integers: the id every example ends with, as a tokenizer's output ends with its end-of-sequence token (T5- and
    # BART-style classification heads pool at it and refuse an input without one)
    last: int | None = None

    def __repr__(self) -> str:
        """As the user writes it (NAME:DTYPE[SHAPE], a dynamic size as seq=128): messages show a spec, or a tuple
        of them, in the notation of --input, never as a dataclass."""
        named = dict(self.dynamic)
        dims = ",".join(f"{named[i]}={d}" if i in named else str(d) for i, d in enumerate(self.shape))
        return f"{self.name}:{self.dtype}[{dims}]"

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "high": self.high}
        if self.dynamic:
            out["dynamic"] = {str(d): n for d, n in self.dynamic}
        if self.positional:
            out["positional"] = True
        if self.last is not None:
            out["last"] = self.last
        return out


InputSpec = tuple[TensorSpec, ...]
ExampleInput = InputSpec | Sequence[int]  # what the public functions take: normalised at once (as_spec)


def batch_of(spec: InputSpec) -> int:
    """The example batch size: the first dimension of the first input."""
    return int(spec[0].shape[0])


def first_shape(spec: InputSpec) -> list[int]:
    """The first input's shape: what reports and files show as `input_shape` (older readers read only that)."""
    return list(spec[0].shape)


def is_positional(spec: InputSpec) -> bool:
    """A bare shape's spec: one input passed positionally, reported as `input_shape` alone."""
    return len(spec) == 1 and spec[0].positional


def shown(spec: InputSpec) -> str:
    """A spec in messages: a bare shape as a tuple `(1, 3, 32, 32)`, named inputs as `name:[1, 16]:int64, ...`."""
    if is_positional(spec):
        return str(tuple(spec[0].shape))
    return ", ".join(f"{t.name}:{list(t.shape)}:{t.dtype}" for t in spec)


def report_fields(spec: InputSpec) -> dict[str, Any]:
    """A report's input fields: `input_shape` (the first input's shape), and `inputs` (each input's record) unless
    the spec is a bare shape."""
    if is_positional(spec):
        return {"input_shape": first_shape(spec)}
    return {"input_shape": first_shape(spec), "inputs": records(spec)}


def plain_spec(shape: Sequence[int], name: str = "x", dtype: str = "float32") -> InputSpec:
    """A bare shape (N,C,H,W …) as a one-tensor spec: float32 unless given, passed positionally."""
    return (replace(_tensor_spec(name, shape, dtype), positional=True),)


def _tensor_spec(
    name: str, shape: Sequence[int], dtype: str, high: int | None = None, dynamic: Any = None, last: int | None = None
) -> TensorSpec:
    if not is_identifier(name):
        raise InputError(
            f"input name {name[:40]!r} is not a plain identifier",
            "name inputs as the forward's arguments, e.g. input_ids",
        )
    dims = tuple(int(d) for d in shape)
    if not dims or len(dims) > 8 or any(d <= 0 or d > 1 << 16 for d in dims) or torch.Size(dims).numel() > 1 << 26:
        raise InputError(
            f"input {name}: shape {list(dims)} is not a valid example shape "
            "(1 to 8 sizes, each 1 to 65,536, at most 2^26 elements)",
            "e.g. input_ids:1x16:int64",
        )
    if dtype not in DTYPES:
        raise InputError(f"input {name}: unknown dtype {dtype[:20]!r}", f"one of {', '.join(sorted(DTYPES))}")
    if last is not None and (
        type(last) is not int or last < 0 or DTYPES[dtype].is_floating_point or (high is not None and last >= high)
    ):
        raise InputError(
            f"input {name}: last={str(last)[:20]} is not an integer id below its bound {high}",
            "give the end-of-sequence id of the model's vocabulary",
        )
    return TensorSpec(name, dims, dtype, high, _dynamic(name, dims, dynamic), last=last)


def _dynamic(name: str, dims: tuple[int, ...], declared: Any) -> tuple[tuple[int, str], ...]:
    """Declared dynamic dimensions {dim: name} checked: a later dimension of the input, a plain name, a size ≥ 2
    (torch.export fixes sizes 0 and 1, so such a dimension cannot stay dynamic)."""
    if not declared:
        return ()
    if not isinstance(declared, Mapping) or len(declared) > len(dims):
        raise InputError(
            f"input {name}: its dynamic dimensions are not a map dim → name", "e.g. input_ids:int64[1,seq=128]"
        )
    out = []
    for d, dim_name in declared.items():
        if (
            not (isinstance(d, str) and d.isdigit() and 1 <= int(d) < len(dims))
            or not is_identifier(str(dim_name))
            or dim_name == "batch"
        ):
            raise InputError(
                f"input {name}: dimension {str(d)[:8]}={str(dim_name)[:40]} cannot be declared dynamic "
                "(a later dimension than the batch, named by a plain name other than batch)",
                "e.g. input_ids:int64[1,seq=128]; the batch (dim 0) is always dynamic",
            )
        if dims[int(d)] < 2:
            raise InputError(
                f"input {name}: the dynamic dimension {dim_name} has the example size {dims[int(d)]}, "
                "which torch.export fixes",
                f"give an example size of at least 2, e.g. {dim_name}=16",
            )
        out.append((int(d), str(dim_name)))
    return tuple(sorted(out))


def _items(text: str) -> list[str]:
    """The inputs of a spec's text: split at commas or spaces outside brackets that start a new name."""
    parts = [p for p in re.split(r"([\[\]])", text.strip()) if p]
    items, depth, current = [], 0, ""
    for p in parts:
        depth += {"[": 1, "]": -1}.get(p, 0)
        if depth == 0 and p not in "[]":
            pieces = re.split(r"[,\s]+(?=[A-Za-z_])", p)
            current += pieces[0]
            for piece in pieces[1:]:
                items.append(current)
                current = piece
        else:
            current += p
    items.append(current)
    return [i.strip(", ") for i in items if i.strip(", ")]


_BRACKETED = re.compile(
    r"^(?P<name>[^:\[\]]+):(?P<dtype>\w+)\[(?P<dims>(?:[A-Za-z_]\w*=)?\d+(?:[,\s]+(?:[A-Za-z_]\w*=)?\d+)*)\]$"
)


def parse_spec(text: Any) -> InputSpec:
    """`name:1x16:int64,name2:1x16` (dtype float32 when left out) or `name:int64[1,16]`, a dict, records or
    TensorSpecs → an input spec."""
    if isinstance(text, TensorSpec):
        text = (text,)
    if isinstance(text, (list, tuple)) and text and all(isinstance(t, TensorSpec) for t in text):
        return _unique([_checked(t) for t in text])
    if isinstance(text, str):
        items = _items(text)
        out = []
        for item in items:
            bracketed = _BRACKETED.match(item)
            if bracketed:  # NAME:DTYPE[d0,seq=d1,...]: a named size is a dynamic dimension
                sizes, dynamic = [], {}
                for i, d in enumerate(p for p in re.split(r"[,\s]+", bracketed["dims"].strip()) if p):
                    dim_name, _, size = d.rpartition("=")
                    if dim_name:
                        dynamic[str(i)] = dim_name
                    sizes.append(int(size))
                out.append(_tensor_spec(bracketed["name"], sizes, bracketed["dtype"], None, dynamic))
                continue
            parts = item.split(":")
            if len(parts) not in (2, 3):
                raise InputError(
                    f"input spec {item[:60]!r} is not NAME:SHAPE[:DTYPE] or NAME:DTYPE[SHAPE]",
                    "e.g. input_ids:1x16:int64 or input_ids:int64[1,16]",
                )
            try:
                dims = [int(d) for d in re.split(r"[x×]", parts[1])]
            except ValueError:
                raise InputError(
                    f"input spec {item[:60]!r}: the shape is not integers joined by x", "e.g. input_ids:1x16:int64"
                ) from None
            out.append(_tensor_spec(parts[0], dims, parts[2] if len(parts) == 3 else "float32"))
        return _unique(out)
    if isinstance(text, Mapping):
        return _unique([_from_value(str(k), v) for k, v in text.items()])
    if isinstance(text, (list, tuple)) and text and all(isinstance(r, Mapping) for r in text):  # stored records
        specs = [
            _tensor_spec(
                str(r["name"]),
                r["shape"],
                str(r.get("dtype", "float32")),
                int(r["high"]) if r.get("high") is not None else None,
                r.get("dynamic"),
                r.get("last"),
            )
            for r in text
        ]
        if len(text) == 1 and text[0].get("positional") is True:
            specs = [replace(specs[0], positional=True)]
        return _unique(specs)
    raise InputError(
        f"cannot read an example input from {type(text).__name__} {str(text)[:60]}",
        "give a shape [N, C, H, W], NAME:SHAPE:DTYPE,..., TensorSpecs or a dict name → shape",
    )


def _checked(t: TensorSpec) -> TensorSpec:
    """A TensorSpec built in Python, checked as one parsed from text is."""
    out = _tensor_spec(t.name, t.shape, t.dtype, t.high, {str(d): n for d, n in t.dynamic}, t.last)
    return replace(out, positional=t.positional)


def _dtype_name(name: str, dtype: torch.dtype) -> str:
    found = next((k for k, d in DTYPES.items() if d == dtype), None)
    if found is None:
        raise InputError(f"input {name}: dtype {dtype} is not supported", f"one of {', '.join(sorted(DTYPES))}")
    return found


def _from_value(name: str, v: Any) -> TensorSpec:
    if isinstance(v, TensorSpec):
        if v.name != name:
            raise InputError(
                f"input {name[:40]!r} is given a TensorSpec named {v.name[:40]!r}",
                "name each TensorSpec as its key, or pass a tuple of TensorSpecs",
            )
        return _checked(v)
    if isinstance(v, torch.Tensor):
        return _tensor_spec(name, tuple(v.shape), _dtype_name(name, v.dtype))
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], (str, torch.dtype)):
        dtype = v[1] if isinstance(v[1], str) else _dtype_name(name, v[1])
        return _tensor_spec(name, _dims(name, v[0]), dtype)
    return _tensor_spec(name, _dims(name, v), "float32")


def _dims(name: str, value: Any) -> tuple[int, ...]:
    """A shape given in Python: a flat list or tuple of ints (torch.Size too); InputError on anything else."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise InputError(
            f"input {name}: {str(value)[:60]} is not a shape (a flat list of ints)",
            "e.g. [1, 3, 32, 32], (shape, dtype), a TensorSpec or an example tensor",
        )
    return tuple(value)


def _unique(specs: list[TensorSpec]) -> InputSpec:
    names = [s.name for s in specs]
    if not specs or len(specs) > MAX_INPUTS or len(set(names)) != len(names):
        raise InputError(
            f"an input spec needs 1 to {MAX_INPUTS} inputs with distinct names, got {names[:20]}",
            "e.g. input_ids:1x16:int64",
        )
    sizes: dict[str, int] = {}
    for t in specs:
        for d, dim_name in t.dynamic:
            if sizes.setdefault(dim_name, t.shape[d]) != t.shape[d]:
                raise InputError(
                    f"the dynamic dimension {dim_name} has the example sizes {sizes[dim_name]} and {t.shape[d]}",
                    "one name, one size: inputs sharing a dynamic dimension share its example size",
                )
    return tuple(specs)


def records(spec: InputSpec) -> list[dict[str, Any]]:
    return [t.record() for t in spec]


def first_embedding(model: nn.Module) -> nn.Embedding | None:
    """The embedding whose vocabulary bounds drawn token ids: the model's first nn.Embedding (a subclass too)."""
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _high(model: nn.Module, t: TensorSpec) -> int:
    if t.high is not None:
        return t.high
    if t.name.endswith("mask") or t.name == "token_type_ids":
        return 2
    emb = first_embedding(model)
    if emb is None:
        raise InputError(
            f"input {t.name} is {t.dtype} but the model has no nn.Embedding to take a vocabulary size from",
            "give the range in Python: TensorSpec(name, shape, dtype, high=N)",
        )
    return int(emb.num_embeddings)


def spec_inputs(model: nn.Module, spec: InputSpec, seed: int = 0, batch: int | None = None) -> dict[str, torch.Tensor]:
    """Seeded example inputs for `spec` (batch replaced when given), on the model's device."""
    g = torch.Generator().manual_seed(seed)
    device, float_dtype = module_device(model), module_dtype(model)
    out = {}
    for t in spec:
        shape = list(t.shape)
        if batch is not None:
            shape[0] = batch
        dtype = DTYPES[t.dtype]
        if dtype.is_floating_point:
            x = torch.randn(shape, generator=g).to(float_dtype if dtype == torch.float32 else dtype)
        elif t.name.endswith("mask"):
            x = torch.ones(shape, dtype=dtype)
        else:
            high = _high(model, t)
            if t.last is not None and high > 1:  # the end id at the end only, as a tokenizer writes it
                x = torch.randint(0, high - 1, shape, generator=g)
                x = (x + (x >= t.last).long()).to(dtype)
                x[..., -1] = t.last
            else:
                x = torch.randint(0, high, shape, generator=g).to(dtype)
        out[t.name] = x.to(device)
    return out


def first_input_name(model: Any) -> str:
    """What a bare shape's input is named: the forward's first parameter (a GraphModule's placeholder), else x."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return "x"
    return next((p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)), "x")


def named_for(model: Any, spec: InputSpec) -> InputSpec:
    """A bare shape's spec named after `model`'s first input (the name shows in files; the call is positional)."""
    if not is_positional(spec):
        return spec
    name = first_input_name(model)
    return spec if spec[0].name == name or not is_identifier(name) else (replace(spec[0], name=name),)


def as_spec(value: Any, model: Any = None) -> InputSpec:
    """An entry point's example input as its spec: TensorSpecs as they are; a bare shape (ints) as its one-tensor
    spec (named after `model`'s first input when given); a dict, spec text or records parsed (parse_spec)."""
    if isinstance(value, tuple) and value and all(isinstance(t, TensorSpec) for t in value):
        return value
    if (
        isinstance(value, (list, tuple, torch.Size))
        and value
        and all(isinstance(d, int) and not isinstance(d, bool) for d in value)
    ):
        spec = plain_spec(value)
        return named_for(model, spec) if model is not None else spec
    return parse_spec(value)


def check_names(model: nn.Module, spec: InputSpec) -> None:
    """Every input of a spec must be a parameter of the model's forward: a mismatch would fail deep inside torch.
    A bare shape's one input is passed positionally: its name is not checked."""
    if is_positional(spec):
        return
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return  # **kwargs takes any name
    names = [p.name for p in params if p.kind != p.VAR_POSITIONAL]
    unknown = [t.name for t in spec if t.name not in names]
    if unknown:
        raise InputError(
            f"{type(model).__name__}.forward takes ({', '.join(names)}); the input spec names "
            f"{', '.join(unknown)}, which it does not take",
            f"name each input after a forward argument, e.g. {names[0] if names else 'x'}:float32[1,3,32,32]",
        )


def call(model: Any, x: Any) -> Any:
    """Run a model on an example input: a tensor positionally, a spec's dict by name."""
    return model(**x) if isinstance(x, dict) else model(x)


def positional(x: Any) -> tuple[Any, ...]:
    """An example input as the captured graph's placeholders take it (fx.Interpreter.run(*...))."""
    return tuple(x.values()) if isinstance(x, dict) else (x,)


def fixed_dims(spec: InputSpec) -> dict[str, set[int]]:
    """Per input, the dimensions torch.export captures at the example's size: every dimension but the batch of a
    float input of four or more dimensions (an image's channels and size, a video's), unless the spec declares it
    dynamic (x:float32[1,3,h=224,w=224]). Symbolic image sizes buy nothing the checks or the ONNX file use (both keep
    the spec's sizes; the batch and declared dimensions stay dynamic) and cost much: TF-'same' padding computed from a
    symbolic size made a MobileNetV3's capture 200 CPU s instead of 24. Token ids, masks, waveforms and (B, T, C)
    feature sequences keep every dimension dynamic where the model allows, as their lengths vary by use."""
    return {
        t.name: set(range(1, len(t.shape))) - {d for d, _ in t.dynamic}
        for t in spec
        if len(t.shape) >= 4 and DTYPES[t.dtype].is_floating_point
    }
