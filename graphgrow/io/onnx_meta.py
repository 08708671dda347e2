"""graphgrow's metadata in an ONNX file, read back: the keys an export writes, a file opened safely (load_onnx:
external data only from beside it), the mutation log, origin, factory seed and example input it records, and
describe_onnx (`graphgrow inspect` of a .onnx file). The writing side is export.py."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import onnx

from ..core.errors import LoadError, first_line
from ..core.names import is_identifier
from ..graph.inputs import InputSpec, first_shape, is_positional, plain_spec
from .lineage import is_origin
from .onnx_external import check_external, external_tensors
from .onnx_spec import INPUTS_KEY, read_spec
from .serialize import is_stored_shape, validate_meta

LOG_KEY = "graphgrow.mutation_log"
ORIGIN_KEY = "graphgrow.origin"  # lineage.structure_fingerprint of the model the log starts from
INPUT_SHAPE_KEY = "graphgrow.input_shape"
SOURCE_KEY = "graphgrow.source"  # the factory name a model was built from (files carry their own weights)
FACTORY_SEED_KEY = "graphgrow.factory_seed"  # the seed that factory's random weights were drawn with


def metadata(proto: onnx.ModelProto) -> dict[str, str]:
    """The model's metadata_props as a dict."""
    return {p.key: p.value for p in proto.metadata_props}


def mutation_log(proto: onnx.ModelProto) -> list[dict[str, Any]]:
    """The mutation log stored in an exported model ([] when none), checked like a graphgrow file's."""
    value = metadata(proto).get(LOG_KEY)
    if not value:
        return []
    try:
        log = json.loads(value)
    except (ValueError, RecursionError) as e:
        raise LoadError(
            f"the ONNX file's mutation log is not readable JSON: {first_line(e)}", "the file is corrupted or hostile"
        ) from e
    checked: list[dict[str, Any]] = validate_meta({"log": log})["log"]
    return checked


def onnx_factory_seed(proto: onnx.ModelProto) -> int | None:
    """The seed a factory's random weights were drawn with, as the export recorded it (None: not recorded)."""
    value = metadata(proto).get(FACTORY_SEED_KEY)
    if value is None:
        return None
    if not re.fullmatch(r"\d{1,19}", value) or int(value) >= 2**63:
        raise LoadError(
            f"the ONNX file records the factory seed {value[:40]!r}, which is not a seed",
            "pass --seed N, or export the model again",
        )
    return int(value)


def onnx_origin(proto: onnx.ModelProto) -> str | None:
    """The origin fingerprint an export recorded (None for files exported before origins were)."""
    value = metadata(proto).get(ORIGIN_KEY)
    if value is not None and not is_origin(value):
        raise LoadError("the ONNX file's origin fingerprint is malformed", "the file is corrupted or hostile")
    return value


def load_onnx(path: str | os.PathLike[str]) -> onnx.ModelProto:
    from ..core.errors import LoadError

    p = Path(path)
    if not p.is_file():
        raise LoadError(f"no such ONNX file: {p}", "check the path")
    from .outputs import protect

    protect(p)  # no output of this run replaces it, under any name
    try:
        proto = onnx.load(str(p), load_external_data=False)  # external data would name other files to read
    except Exception as e:
        raise LoadError(
            f"{p} is not a readable ONNX model: {first_line(e, 200)}", "pass a file written by graphgrow export"
        ) from e
    external = external_tensors(proto)
    if external:
        check_external(proto, p, external)  # only NAME.onnx.data beside NAME.onnx, at the lengths the tensors need
    return proto


def onnx_input_shape(proto: onnx.ModelProto) -> InputSpec | None:
    """The example input: the input spec an export with named inputs stored; else the one input's
    shape (as its one-tensor spec, named as the ONNX input) from graphgrow's metadata, or from the ONNX input
    (dynamic dims → 1)."""
    spec = read_spec(metadata(proto))
    if spec is not None:
        return spec
    stored = metadata(proto).get(INPUT_SHAPE_KEY)
    if stored:
        try:
            shape = json.loads(stored)
        except (ValueError, RecursionError):
            shape = None
        if not is_stored_shape(shape):
            raise LoadError(
                f"the ONNX file stores the input shape {stored[:80]!r}, which is not a shape",
                "pass --input-shape N,C,H,W, or export the model again",
            )
    elif not proto.graph.input:
        return None
    else:
        shape = [d.dim_value if d.dim_value > 0 else 1 for d in proto.graph.input[0].type.tensor_type.shape.dim]
    if not shape:
        return None
    name = proto.graph.input[0].name if proto.graph.input else "x"
    return plain_spec(shape, name if is_identifier(name) else "x")


def describe_onnx(path: str) -> dict[str, Any]:
    """An exported ONNX file: inputs, outputs, op histogram, parameters, graphgrow's metadata and mutation log."""
    import collections

    import onnx

    proto = load_onnx(path)

    def dims(value_info: onnx.ValueInfoProto) -> list[int | str]:
        return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]

    def elem(value_info: onnx.ValueInfoProto) -> str:
        return str(onnx.TensorProto.DataType.Name(value_info.type.tensor_type.elem_type)).lower()

    meta = metadata(proto)
    params = sum(
        math.prod(t.dims) for t in proto.graph.initializer
    )  # Python ints: np.prod would overflow on hostile dims
    return {
        "model": path,
        "format": "onnx",
        "ir_version": proto.ir_version,
        "opset": [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")][:1],
        "producer": f"{proto.producer_name} {proto.producer_version}".strip(),
        "inputs": [{"name": i.name, "shape": dims(i), "dtype": elem(i)} for i in proto.graph.input],
        "outputs": [{"name": o.name, "shape": dims(o), "dtype": elem(o)} for o in proto.graph.output],
        "nodes": len(proto.graph.node),
        "ops": dict(collections.Counter(n.op_type for n in proto.graph.node).most_common()),
        "params": params,
        **_described_input(proto, meta),
        **_described_external(proto),
        "log": mutation_log(proto),
        "metadata": {k: v for k, v in meta.items() if k != LOG_KEY},
    }


def _described_external(proto: onnx.ModelProto) -> dict[str, Any]:
    """The data files beside the model and the bytes they hold (nothing for a self-contained file)."""
    from .onnx_external import external_bytes, external_files

    files = external_files(proto)
    return {"external_data": {"files": files, "bytes": external_bytes(proto)}} if files else {}


def _described_input(proto: onnx.ModelProto, meta: dict[str, str]) -> dict[str, Any]:
    """describe_onnx's input fields: the (first) input's shape, and the spec's records when one is stored."""
    shape = onnx_input_shape(proto) if INPUT_SHAPE_KEY in meta or INPUTS_KEY in meta else None
    if shape is None:
        return {"input_shape": None}
    if is_positional(shape):
        return {"input_shape": first_shape(shape)}
    return {"input_shape": first_shape(shape), "input_spec": [t.record() for t in shape]}
