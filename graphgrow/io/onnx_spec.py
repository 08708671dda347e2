"""ONNX for models with named inputs and structured outputs (issue 22): the plan export_onnx follows.

Inputs: one ONNX input per entry of the input spec, named after it, with its dtype. Dynamic
dimensions: dim 0 of every input, named `batch`; dim 1 of every rank-2 integer input (token ids,
attention masks), named `sequence` (`sequence_2`, … for inputs of another example length), unless
the model does not allow it — it fails at a second length (a Linear over the flattened sequence) or
torch.export cannot keep the length symbolic. Then the length stays the example's, and the
metadata key `graphgrow.static_sequence` says which inputs, which length and why.

Outputs: the model's output flattened leaf by leaf in pytree order (dict and ModelOutput keys in
their order, tuples and lists by index), each tensor named by its key path joined with dots:
`logits`, `last_hidden_state`, `hidden_states.0`, `past.0.1`; a top-level tuple's leaves are
`output.0`, `output.1`, …; a lone tensor is `output`. The onnxruntime check flattens PyTorch's
output the same way and matches the two by these names.

Metadata: `graphgrow.inputs` (the spec's records, JSON: name, shape, dtype, high),
`graphgrow.input_shape` (the first input's shape, for older readers) and `graphgrow.dynamic_dims`
({input: {dim: name}}). This module does not call the exporter (export.py owns torch.onnx).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import onnx
import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, tree_flatten_with_path

from ..core.errors import GraphgrowError, InputError, LoadError, first_line
from ..graph.inputs import DTYPES, InputSpec, TensorSpec, call, parse_spec, spec_inputs

INPUTS_KEY = "graphgrow.inputs"
DYNAMIC_KEY = "graphgrow.dynamic_dims"
STATIC_KEY = "graphgrow.static_sequence"
BATCH = "batch"
MAX_SPEC_TEXT = 1 << 16  # bytes of stored spec JSON read at most (16 inputs need a few hundred)


def is_token_input(t: TensorSpec) -> bool:
    """A rank-2 integer input (token ids, an attention mask): its dim 1 is a sequence length."""
    return len(t.shape) == 2 and not DTYPES[t.dtype].is_floating_point and DTYPES[t.dtype] != torch.bool


def dynamic_groups(spec: InputSpec) -> dict[str, list[tuple[str, int]]]:
    """Each dynamic dimension but the batch, by name → the (input, dim) pairs it sizes.

    Declared in the spec (`input_ids:int64[1,seq=128]`) when any input declares one; otherwise dim 1 of the
    token inputs, grouped by example length (token ids and their mask share one). A length below 2 is left
    out: torch.export fixes sizes 0 and 1, so it cannot stay dynamic."""
    if any(t.dynamic for t in spec):
        declared: dict[str, list[tuple[str, int]]] = {}
        for t in spec:
            for d, dim_name in t.dynamic:
                declared.setdefault(dim_name, []).append((t.name, d))
        return declared
    by_length: dict[int, list[tuple[str, int]]] = {}
    for t in spec:
        if is_token_input(t) and t.shape[1] >= 2:
            by_length.setdefault(t.shape[1], []).append((t.name, 1))
    return {("sequence" if i == 0 else f"sequence_{i + 1}"): members for i, members in enumerate(by_length.values())}


def dynamic_dims(spec: InputSpec, sequence: bool) -> dict[str, dict[int, str]]:
    """Per input, its dynamic dimensions by name (torch.onnx.export's dynamic_shapes with named dims);
    without `sequence` only the batch."""
    dims: dict[str, dict[int, str]] = {t.name: {0: BATCH} for t in spec}
    if sequence:
        for dim_name, members in dynamic_groups(spec).items():
            for name, d in members:
                dims[name][d] = dim_name
    return dims


def shorter_length(length: int) -> int:
    """The second length checked for a dynamic dimension (and probed before export): half the example's."""
    return max(1, length // 2)


def with_shorter_sequence(spec: InputSpec, dims: dict[str, Any]) -> InputSpec:
    """`spec` with every dynamic dimension but the batch halved (`dims`: input → {dim: name, or a size when fixed})."""

    def shorter(t: TensorSpec) -> TensorSpec:
        d = dims.get(t.name) or {}
        shape = tuple(shorter_length(n) if i > 0 and isinstance(d.get(i), str) else n for i, n in enumerate(t.shape))
        return dataclasses.replace(t, shape=shape) if shape != t.shape else t

    return tuple(shorter(t) for t in spec)


def check_input_names(gm: torch.nn.Module, spec: InputSpec) -> None:
    """The inputs are passed by keyword: a graph's placeholders must be the spec's names."""
    if not isinstance(gm, fx.GraphModule):
        return
    takes = [str(n.target).lstrip("*") for n in gm.graph.nodes if n.op == "placeholder"]
    if sorted(takes) != sorted(t.name for t in spec):
        raise InputError(
            f"the graph takes the inputs {takes[:16]}, the input spec names {[t.name for t in spec]}",
            "name the spec's inputs after the forward's arguments",
        )


def captured_static(gm: torch.nn.Module, groups: dict[str, list[tuple[str, int]]]) -> str | None:
    """A length torch.export fixed when the model was captured: the graph holds only the code for that length
    (`if input_ids.shape[1] == 16: ...` kept one branch), so it must not be exported as dynamic. Read from the
    placeholders' example values, which a captured graph keeps until it is saved."""
    dims = {(name, d): dim_name for dim_name, members in groups.items() for name, d in members}
    for n in gm.graph.nodes if isinstance(gm, fx.GraphModule) else []:
        val = n.meta.get("val") if n.op == "placeholder" else None
        for (name, d), dim_name in dims.items():
            if (
                str(n.target) == name
                and isinstance(val, torch.Tensor)
                and val.dim() > d
                and is_concrete_int(val.shape[d])
            ):
                return (
                    f"torch.export fixed {dim_name} (dim {d} of {name}) at {val.shape[d]} when the model was captured "
                    "(its code depends on that size)"
                )
    return None


def fails_shorter(gm: torch.nn.Module, spec: InputSpec, feeds: dict[str, Any], leaves: int) -> str | None:
    """Why the model cannot take shorter dynamic dimensions (it fails there, or its output changes structure);
    None when it can."""
    shorter = with_shorter_sequence(spec, dynamic_dims(spec, True))
    shapes = {t.name: t.shape for t in spec}
    sizes = ", ".join(
        f"{dim_name}={shorter_length(shapes[members[0][0]][members[0][1]])}"
        for dim_name, members in dynamic_groups(spec).items()
    )
    try:
        out = call(gm, spec_inputs(gm, shorter, seed=1, batch=next(iter(feeds.values())).shape[0]))
    except Exception as e:  # noqa: BLE001 - any failure means the length is fixed; the reason is recorded
        return f"the model fails at {sizes}: {first_line(e, 200)}"
    if len(named_leaves(out)) != leaves:
        return f"the model's output changes structure at {sizes}"
    return None


def name_dict_outputs(gm: torch.nn.Module, proto: onnx.ModelProto) -> None:
    """One float input, a dict output (a captured Hugging Face model): name the outputs after its keys."""
    out = gm.graph.output_node().args[0] if isinstance(gm, fx.GraphModule) else None
    if isinstance(out, dict):
        names = [n for n, _ in named_leaves(out, fx.Node)]
        if len(names) == len(proto.graph.output):
            name_outputs(proto, names)


def _key(k: Any) -> str:
    if isinstance(k, MappingKey):
        return str(k.key)
    if isinstance(k, SequenceKey):
        return str(k.idx)
    if isinstance(k, GetAttrKey):
        return k.name
    return str(k)


def named_leaves(out: Any, kind: type = torch.Tensor) -> list[tuple[str, Any]]:
    """The tensors (or other leaves of type `kind`: a graph's output nodes) of a model output in pytree
    order, each with its dotted key path (see the module doc)."""
    if isinstance(out, kind):
        return [("output", out)]
    leaves = [(path, v) for path, v in tree_flatten_with_path(out)[0] if isinstance(v, kind)]
    names = []
    for path, _ in leaves:
        parts = [_key(k) for k in path]
        if not path or isinstance(path[0], SequenceKey):
            parts.insert(0, "output")
        names.append(".".join(parts))
    return list(zip(names, (v for _, v in leaves)))


def name_outputs(proto: onnx.ModelProto, names: list[str]) -> None:
    """Rename the graph outputs, in order, to `names`. An inner value that already has one of the names
    is renamed out of the way; an output that is also a graph input, an initializer or an earlier output
    gets an Identity; a name a graph input has is taken with a suffix (`input_ids_1`)."""
    graph = proto.graph
    if len(names) != len(graph.output):
        raise GraphgrowError(
            f"the exported model has {len(graph.output)} outputs but the PyTorch output has {len(names)} tensors",
            "please report this with the model",
        )
    fixed = {i.name for i in graph.input}
    taken = _all_names(graph) | set(names)
    names = [_fresh(n, taken) if n in fixed else n for n in names]
    keep = {o.name for o, n in zip(graph.output, names) if o.name == n}
    _rename(graph, {n: _fresh(n, taken | set(names)) for n in (_all_names(graph) & set(names)) - keep})
    done: set[str] = set()
    for out, new in zip(graph.output, names):
        old = out.name  # read now: an earlier rename may have changed it
        if old != new:
            if old in fixed or old in done or any(t.name == old for t in graph.initializer):
                graph.node.add(op_type="Identity", input=[old], output=[new], name=f"{new}/Identity")
                out.name = new
            else:
                _rename(graph, {old: new})
        done.add(new)


def _fresh(base: str, taken: set[str]) -> str:
    i = 1
    while f"{base}_{i}" in taken:
        i += 1
    return f"{base}_{i}"


def _subgraphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("g"):
                yield a.g
            yield from a.graphs


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names = {v.name for v in [*graph.input, *graph.output, *graph.value_info]} | {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(n for n in [*node.input, *node.output] if n)
    for g in _subgraphs(graph):
        names |= _all_names(g)
    return names


def _rename(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename values everywhere, subgraphs included (their outer-scope references too): the exporter's
    value names are unique across the whole model."""
    if not mapping:
        return
    for v in [*graph.input, *graph.output, *graph.value_info, *graph.initializer]:
        v.name = mapping.get(v.name, v.name)
    for node in graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        node.output[:] = [mapping.get(n, n) for n in node.output]
    for g in _subgraphs(graph):
        _rename(g, mapping)


def spec_metadata(spec: InputSpec, dims: dict[str, dict[int, str]], static: dict[str, Any] | None) -> dict[str, str]:
    """The metadata_props an export with named inputs writes (see the module doc)."""
    props = {
        INPUTS_KEY: json.dumps([t.record() for t in spec]),
        DYNAMIC_KEY: json.dumps({k: {str(d): n for d, n in v.items()} for k, v in dims.items()}),
    }
    if static:
        props[STATIC_KEY] = json.dumps(static)
    return props


def read_spec(meta: dict[str, str]) -> InputSpec | None:
    """The input spec an export stored (None when it stored none); LoadError when it is not one."""
    value = meta.get(INPUTS_KEY)
    if value is None:
        return None
    bad = LoadError(
        f"the ONNX file's input spec ({INPUTS_KEY}) is not a list of inputs with names, shapes and dtypes",
        "pass --input NAME:SHAPE:DTYPE, or export the model again",
    )
    if len(value) > MAX_SPEC_TEXT:
        raise bad
    try:
        records = json.loads(value)
    except (ValueError, RecursionError):
        raise bad from None
    if not isinstance(records, list) or not all(_is_record(r) for r in records):
        raise bad
    try:
        return parse_spec(records)
    except GraphgrowError as e:
        raise LoadError(f"the ONNX file's input spec is not valid: {e.message}", bad.hint) from None


def _is_record(r: Any) -> bool:
    high = r.get("high") if isinstance(r, dict) else None
    return (
        isinstance(r, dict)
        and isinstance(r.get("name"), str)
        and isinstance(r.get("dtype", "float32"), str)
        and isinstance(r.get("shape"), list)
        and all(type(d) is int for d in r["shape"])
        and (high is None or (type(high) is int and 0 < high < 1 << 62))
        and (r.get("last") is None or (type(r.get("last")) is int and 0 <= r["last"] < 1 << 62))
    )
