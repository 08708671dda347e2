"""ONNX export (the only importer of torch.onnx): dynamo exporter, dynamic batch, one self-contained file, or
the graph and a data file beside it past protobuf's 2 GiB (onnx_external.py)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import fx

from ..core.errors import ExportError, first_line
from ..core.state import training_mode
from ..graph.inputs import (
    ExampleInput,
    InputSpec,
    as_spec,
    batch_of,
    call,
    first_shape,
    is_positional,
    spec_inputs,
)
from ..graph.lean_meta import lean_tensor_meta
from ..graph.shapes import example_input, state_bytes
from .lineage import origin_of
from .onnx_attention import four_d_attention
from .onnx_complex import real_pairs
from .onnx_external import ExternalWrite, data_path
from .onnx_integers import exact_integers

# The readers moved to onnx_meta.py; they stay importable from here, where callers import them (`X as X`: re-exported).
from .onnx_meta import FACTORY_SEED_KEY as FACTORY_SEED_KEY
from .onnx_meta import INPUT_SHAPE_KEY, LOG_KEY, ORIGIN_KEY
from .onnx_meta import SOURCE_KEY as SOURCE_KEY
from .onnx_meta import describe_onnx as describe_onnx
from .onnx_meta import load_onnx as load_onnx
from .onnx_meta import metadata as metadata
from .onnx_meta import mutation_log as mutation_log
from .onnx_meta import onnx_factory_seed as onnx_factory_seed
from .onnx_meta import onnx_input_shape as onnx_input_shape
from .onnx_meta import onnx_origin as onnx_origin
from .onnx_optimizer import tuned_optimizer
from .onnx_spec import (
    captured_static,
    check_input_names,
    dynamic_dims,
    dynamic_groups,
    fails_shorter,
    is_token_input,
    name_dict_outputs,
    name_outputs,
    named_leaves,
    spec_metadata,
)
from .save import atomic_write, check_output_path

INPUT_NAME = "input"


def export_onnx(
    gm: torch.nn.Module,
    input_shape: ExampleInput,
    path: str | os.PathLike[str] | None = None,
    metadata: dict[str, str] | None = None,
    max_ir_version: int | None = None,
    opset: int | None = None,
    timings: dict[str, float] | None = None,
    isolate: bool = False,
    external_data: bool | None = None,
) -> onnx.ModelProto:
    """Export `gm` (in eval mode) with a dynamic batch dimension, check it, and write it atomically.

    The mutation log from gm.meta["graphgrow"] goes into metadata_props under
    "graphgrow.mutation_log" (JSON), with any `metadata` given. `max_ir_version`
    clamps the IR version to what the target onnxruntime accepts. `timings`, when
    given, receives the seconds spent in torch.onnx.export and in total.

    `isolate=True` runs torch.onnx.export in a forked child process: torch.export
    keeps about 0.3 MiB per export alive for the life of the process (measured; the
    references sit outside Python's reach), which a growth loop exporting hundreds of
    times should not pay. Linux/macOS only (fork).

    `input_shape` is the example input: a bare shape (its one-tensor spec: one input, passed positionally), or an
    input spec of named inputs with dtypes (graph.inputs): then the ONNX inputs carry the spec's names and dtypes,
    the sequence length of token inputs is dynamic where the model allows it, and the outputs are named after the
    output's keys (onnx_spec.py).

    `external_data=True` writes the weights to `PATH.data` beside `path` (and returns the graph without
    them); None does so when the weights pass ONE_FILE_MAX, which a self-contained file cannot hold.
    """
    start = time.perf_counter()
    input_shape = as_spec(input_shape, gm)
    out_path = check_output_path(path) if path is not None else None
    if out_path is not None and not _utf8(out_path.name):
        raise ExportError(
            f"the output name {out_path.name!r} is not UTF-8: ONNX stores names as UTF-8 text",
            "choose an output name in UTF-8",
        )
    stage = None
    if wants_external(gm, external_data, out_path):
        check_output_path(data_path(out_path))
        stage = ExternalWrite.stage(out_path)
    try:
        proto, props, t_export = _exported(gm, input_shape, opset, isolate, stage)
        _finish(gm, proto, input_shape, max_ir_version, {**props, **(metadata or {})})
        if stage is not None:
            stage.finish(proto, check_proto)
        elif out_path is None:
            check_proto(proto)
        else:

            def write_checked(tmp: Path) -> None:  # checked from the file: the checker would serialise a proto again
                tmp.write_bytes(
                    proto.SerializeToString()
                )  # the bytes are gone before the checker reads the file (memory)
                check_proto(str(tmp))

            atomic_write(out_path, write_checked)  # a failed write is SaveError (exit 2) naming the output
    except BaseException:
        if stage is not None:
            stage.discard()
        raise
    if timings is not None:
        timings.update(torch_onnx_export=t_export, total=time.perf_counter() - start)
    return proto


def _exported(
    gm: torch.nn.Module, input_shape: InputSpec, opset: int | None, isolate: bool, stage: ExternalWrite | None
) -> tuple[onnx.ModelProto, dict[str, str], float]:
    """torch.onnx.export on the example input or the spec's named inputs; the model, the metadata the export
    adds (the input spec) and the seconds it took."""
    t_export = time.perf_counter()
    gm = real_pairs(gm)  # complex arithmetic as real pairs: ONNX has no complex type (gm itself when it has none)
    gm = exact_integers(gm, input_shape)  # integer powers and sums that onnxruntime would round (onnx_integers)
    gm = four_d_attention(gm)  # attention over more than 4 dims: the exporter takes 4 (onnx_attention)
    if not is_positional(input_shape):
        proto, props = _export_named(gm, input_shape, opset, isolate, stage)
    else:  # a bare shape: the one input passed positionally, only the batch dynamic
        # Export at batch ≥ 2: torch.export specialises sizes 0 and 1 to constants.
        x = example_input(gm, input_shape, seed=0, batch=max(2, batch_of(input_shape)))
        proto = _in_child(_torch_export, gm, x, opset, stage) if isolate else _torch_export(gm, x, opset, stage)
        name_dict_outputs(gm, proto)
        props = {}
    return proto, props, time.perf_counter() - t_export


def _finish(
    gm: torch.nn.Module,
    proto: onnx.ModelProto,
    input_shape: InputSpec,
    max_ir_version: int | None,
    props: dict[str, str],
) -> None:
    """The IR version clamped, nodes named after their modules, `props` and graphgrow's metadata (log, origin,
    input shape) added to the model's."""
    if max_ir_version is not None and proto.ir_version > max_ir_version:
        proto.ir_version = max_ir_version
    name_nodes(proto)
    props = dict(props)
    info = gm.meta.get("graphgrow", {}) if isinstance(gm, fx.GraphModule) else {}
    props.setdefault(LOG_KEY, json.dumps(info.get("log", [])))
    origin = origin_of(gm) if info else None  # info only when gm is a graphgrow GraphModule
    if origin:
        props.setdefault(ORIGIN_KEY, origin)
    props.setdefault(INPUT_SHAPE_KEY, json.dumps(first_shape(input_shape)))
    for k, v in props.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = k, v


def _export_named(
    gm: torch.nn.Module, spec: InputSpec, opset: int | None, isolate: bool, stage: ExternalWrite | None
) -> tuple[onnx.ModelProto, dict[str, str]]:
    """Export on the spec's named inputs (onnx_spec.py has the plan); returns the model and its metadata.

    The sequence length is tried dynamic first; a model that fails at a shorter length, or that
    torch.export cannot export with the length symbolic, is exported with the example's length."""
    check_input_names(gm, spec)
    feeds = spec_inputs(gm, spec, seed=0, batch=max(2, batch_of(spec)))  # batch ≥ 2: sizes 0 and 1 become constants
    groups = dynamic_groups(spec)
    with training_mode(gm, False), torch.no_grad():
        names = [n for n, _ in named_leaves(call(gm, feeds))]
        reason = (captured_static(gm, groups) or fails_shorter(gm, spec, feeds, len(names))) if groups else None
    run = (lambda *a: _in_child(_torch_export_named, *a)) if isolate else _torch_export_named
    proto = None
    if groups and reason is None:
        try:
            proto = run(gm, feeds, dynamic_dims(spec, True), opset, stage)
        except ExportError as e:
            reason = f"with a dynamic sequence length, {e.message}"
    if proto is None:
        proto = run(gm, feeds, dynamic_dims(spec, False), opset, stage)
    exported = sorted(i.name for i in proto.graph.input)
    if exported != sorted(t.name for t in spec):
        raise ExportError(
            f"the exported model's inputs are {exported}, the input spec names {[t.name for t in spec]}",
            "name the spec's inputs after the forward's arguments",
        )
    name_outputs(proto, names)
    static, why = {}, []
    if reason is not None:
        shapes = {t.name: t.shape for t in spec}
        static.update({name: shapes[name][d] for members in groups.values() for name, d in members})
        why.append(reason)
    short = (
        {}
        if any(t.dynamic for t in spec)
        else {t.name: t.shape[1] for t in spec if is_token_input(t) and t.shape[1] < 2}
    )
    if short:
        static.update(short)
        why.append(
            "an example sequence length of 1 cannot stay dynamic (torch.export fixes sizes 0 and 1): "
            "give a longer example"
        )
    record = {"inputs": static, "reason": "; ".join(why)} if static else None
    return proto, spec_metadata(spec, dynamic_dims(spec, reason is None), record)


SCOPES_KEY = "pkg.torch.onnx.name_scopes"  # the exporter's record of the module path each node came from


def _scopes(node: onnx.NodeProto) -> list[str]:
    import ast

    scopes = next((m.value for m in node.metadata_props if m.key == SCOPES_KEY), None)
    try:
        return [str(p) for p in ast.literal_eval(scopes)] if scopes else []
    except (ValueError, SyntaxError):
        return []


def node_module(node: onnx.NodeProto) -> str | None:
    """The path of the module an exported ONNX node computes part of (None for a top-level op)."""
    path = [p for p in _scopes(node)[:-1] if p]
    return path[-1] if path else None


def name_nodes(proto: onnx.ModelProto) -> None:
    """Name each ONNX node after the module it computes, `layer1.0.conv1/Conv` (a top-level op: its
    fx name, `add/Add`), so Netron and error reports show the model's own layer names."""
    taken: set[str] = set()
    for node in proto.graph.node:
        parts = _scopes(node)
        path = node_module(node)
        base = f"{path or (parts[-1] if parts else node.op_type.lower())}/{node.op_type}"
        name, i = base, 1
        while name in taken:
            name, i = f"{base}_{i}", i + 1
        taken.add(name)
        node.name = name


def _root_cause(e: BaseException, lines: int = 1) -> str:
    """The innermost exception's first line (the exporter wraps the real reason), without colour codes;
    with `lines`=2 the next line too when the first only introduces it (ends with a colon)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    first = first_line(text) or type(e).__name__
    rest = [line.strip(" -") for line in text.strip().splitlines()[1:] if line.strip(" -")]
    return f"{first} {first_line(rest[0])}" if lines > 1 and first.endswith(":") and rest else first


PROTOBUF_LIMIT = 2 << 30  # bytes: one protobuf message, so one self-contained .onnx file, holds less than 2 GiB
ONE_FILE_MAX = PROTOBUF_LIMIT - (256 << 20)  # weights up to here go in one file; the rest of the graph needs room too


def wants_external(gm: torch.nn.Module, asked: bool | None, out_path: Path | None) -> bool:
    """Whether the weights go to a data file: as asked, else when they pass ONE_FILE_MAX. Refused before
    torch.onnx.export runs when they cannot go where asked (the export would build the whole model first)."""
    size = state_bytes(gm)
    external = asked if asked is not None else size >= ONE_FILE_MAX
    if not external and size >= ONE_FILE_MAX:
        raise ExportError(
            f"the model's weights are {size / 2**30:.2f} GiB: a self-contained ONNX file holds less than "
            "2 GiB (protobuf's limit) with its graph",
            "export with external data (--external-data)",
        )
    if external and out_path is None:
        raise ExportError(
            "an ONNX model with external data is written as two files, and no output path was given",
            "give an output path: NAME.onnx and NAME.onnx.data are written",
        )
    return external


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")  # a name read from bytes that are not UTF-8 holds surrogates (os.fsdecode)
    except UnicodeEncodeError:
        return False
    return True


def _saved(program: Any, stage: ExternalWrite | None) -> onnx.ModelProto:
    """The exported model as one proto, or (with external data) its weights written to the staged data file."""
    return program.model_proto if stage is None else stage.save(program.model)


def _torch_export(
    gm: torch.nn.Module, x: torch.Tensor, opset: int | None, stage: ExternalWrite | None
) -> onnx.ModelProto:
    captured = io.StringIO()
    batch = torch.export.Dim("batch", min=1)
    try:
        with _inference(gm), warnings.catch_warnings(), _quiet(captured), _registry_once(), tuned_optimizer():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                gm,
                (x,),
                dynamo=True,
                dynamic_shapes=({0: batch},),
                input_names=[INPUT_NAME],
                opset_version=opset,
                optimize=True,
                verbose=False,
                report=False,
            )
    except Exception as e:
        raise ExportError(
            f"torch.onnx.export failed: {_root_cause(e)}",
            "an op in the model may have no ONNX equivalent; run with --debug for the full report",
        ) from e
    return _saved(program, stage)


def _torch_export_named(
    gm: torch.nn.Module,
    feeds: dict[str, torch.Tensor],
    dims: dict[str, dict[int, str]],
    opset: int | None,
    stage: ExternalWrite | None,
) -> onnx.ModelProto:
    """torch.onnx.export on named inputs (passed by keyword), with named dynamic dimensions."""
    captured = io.StringIO()
    try:
        with _inference(gm), warnings.catch_warnings(), _quiet(captured), _registry_once(), tuned_optimizer():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                gm,
                (),
                kwargs=feeds,
                dynamo=True,
                dynamic_shapes=dims,
                opset_version=opset,
                optimize=True,
                verbose=False,
                report=False,
            )
    except Exception as e:
        raise ExportError(
            f"torch.onnx.export failed: {_root_cause(e, lines=2)}",
            "an op in the model may have no ONNX equivalent; run with --debug for the full report",
        ) from e
    return _saved(program, stage)


def _in_child(fn: Callable[..., onnx.ModelProto], *args: Any) -> onnx.ModelProto:
    """Run `fn(*args)` in a forked process (the model is inherited, not pickled); bytes come back."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            send.send(("ok", fn(*args).SerializeToString()))
        except ExportError as e:
            send.send(("error", (e.message, e.hint)))
        except BaseException as e:  # anything else: still one line back to the parent
            send.send(("error", (f"export failed in the child process: {type(e).__name__}: {e}", None)))

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    send.close()
    try:
        kind, payload = receive.recv()
    except EOFError:
        proc.join()
        raise ExportError(
            f"the export process died (exit code {proc.exitcode})", "export without isolate=True to see why"
        ) from None
    proc.join()
    if kind == "error":
        raise ExportError(*payload)
    return onnx.load_model_from_string(payload)


def check_proto(proto: onnx.ModelProto | str) -> None:
    """onnx.checker's full check (which includes strict shape inference) of a model or a model file;
    ExportError on any complaint."""
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as e:
        raise ExportError(
            f"the exported ONNX model fails the ONNX checker: {first_line(e)}", "please report this with the model"
        ) from e


_REGISTRIES: dict[tuple[Any, ...], Any] = {}  # (class, arguments) → the exporter's translation table


@contextlib.contextmanager
def _registry_once() -> Iterator[None]:
    """torch.onnx.export builds its table of ONNX translations (every torchlib function, with its signature) anew on
    each call: 0.4-1 CPU s of the 5-6 s a 2-layer transformer's export takes (measured), paid again by every export
    of a growth loop or sweep. Here it is built once per opset and process; each export gets its own copy of the
    table (one that registers custom translations changes only its copy), so what is exported is the same. With
    another exporter (no such registry class), nothing changes."""
    try:
        from torch.onnx._internal.exporter import _registration

        owner, name = _registration.ONNXRegistry, "from_torchlib"
        built = owner.__dict__[name]
        build = built.__func__
    except (ImportError, AttributeError, KeyError):
        yield
        return

    def from_torchlib(cls: Any, *args: Any, **kwargs: Any) -> Any:
        key = (cls, args, tuple(sorted(kwargs.items())))
        if key not in _REGISTRIES:
            _REGISTRIES[key] = build(cls, *args, **kwargs)
        table = _REGISTRIES[key]
        copy = cls.__new__(cls)
        copy.__dict__.update(table.__dict__)
        copy.functions = {op: list(metas) for op, metas in table.functions.items()}
        return copy

    setattr(owner, name, classmethod(from_torchlib))
    try:
        yield
    finally:
        setattr(owner, name, built)


@contextlib.contextmanager
def _inference(gm: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no autograd for the whole of torch.onnx.export. Without no_grad the exporter traces its graph
    twice in different grad modes: the decomposition without grad, the type-promotion pass that re-runs it with the
    caller's. scaled_dot_product_attention's CPU kernel depends on it (flash, output laid out (B, N, H, D), for a mask
    that needs no grad; math, (B, H, N, D), for one that does), so a mask computed from parameters (BEiT's relative
    position bias gathered from its table) got one layout in the first pass and the other in the second, and the
    view the first pass made of x.transpose(1, 2).reshape(B, N, C) failed in the second ("Cannot view a tensor").
    Also the traced nodes' metadata without memory-format queries (graph/lean_meta.py: same graph, less sympy)."""
    with training_mode(gm, False), torch.no_grad(), lean_tensor_meta():
        yield


@contextlib.contextmanager
def _quiet(sink: io.StringIO) -> Iterator[None]:
    """The exporter prints progress to stdout and logs; keep both off the user's terminal (and --json)."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript", "torch.fx")]
    levels = [l.level for l in loggers]
    for l in loggers:
        l.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        for l, lv in zip(loggers, levels):
            l.setLevel(lv)
