"""ONNX weights kept in a second file (external data): how graphgrow writes them past protobuf's 2 GiB, and
the only form in which it reads them back.

An export with external data is two files side by side: `NAME.onnx` (the graph, small) and
`NAME.onnx.data` (every initializer over 256 bytes; those past 1 MiB 64 KiB-aligned, so onnxruntime can
map them), the names torch.onnx uses too. A file's external-data entries name other files to read, so no
name read from a file chooses what is read: a model file NAME.onnx may keep initializers only in
NAME.onnx.data beside it (a regular file, not a link nor a hard link: graphgrow never writes one, and a link
could lead anywhere below the folder), at offsets and lengths inside that file and
of the size each tensor's shape and type need; never in attributes, subgraphs, functions or sparse
tensors, which graphgrow does not write.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from ..core.errors import LoadError, first_line
from . import outputs

DATA_SUFFIX = ".data"
KEYS = ("location", "offset", "length", "checksum")
_DIGITS = re.compile(
    r"[0-9]{1,19}"
)  # ASCII only: re's \d takes any script's digits, which int() reads and onnxruntime refuses
_T = onnx.TensorProto
ITEM_BYTES: dict[int, int] = {
    _T.FLOAT: 4,
    _T.DOUBLE: 8,
    _T.FLOAT16: 2,
    _T.BFLOAT16: 2,
    _T.INT8: 1,
    _T.UINT8: 1,
    _T.INT16: 2,
    _T.UINT16: 2,
    _T.INT32: 4,
    _T.UINT32: 4,
    _T.INT64: 8,
    _T.UINT64: 8,
    _T.BOOL: 1,
}


def data_path(onnx_path: Path) -> Path:
    """Where the weights of `onnx_path` go: beside it, its name plus `.data`."""
    return onnx_path.with_name(onnx_path.name + DATA_SUFFIX)


MAX_GRAPH_DEPTH = (
    16  # If/Loop/Scan bodies nested deeper than this are refused (real models nest a few; protobuf stops near 30)
)


def is_external(t: onnx.TensorProto) -> bool:
    """A tensor whose bytes live elsewhere: EXTERNAL, or any external_data entry at all (a DEFAULT tensor with
    entries is malformed, and a runtime might still follow them)."""
    return t.data_location == onnx.TensorProto.EXTERNAL or len(t.external_data) > 0


def _sparse_external(s: onnx.SparseTensorProto) -> bool:
    return is_external(s.values) or is_external(s.indices)


def _show(name: str) -> str:
    return repr(name[:80])


def external_tensors(proto: onnx.ModelProto) -> list[str]:
    """Where every tensor that names external data sits, anywhere in the model: initializers, sparse
    initializers, node attributes (t, tensors, sparse_tensor(s)), If/Loop/Scan bodies at any depth up to
    MAX_GRAPH_DEPTH, functions (their nodes and attribute defaults) and training graphs. External data names
    a file (or memory) to read: a self-contained model has none."""
    found: list[str] = []
    graphs: list[tuple[onnx.GraphProto, str, int]] = [(proto.graph, "graph", 0)]
    graphs += [
        (g, f"training graph {i}", 0)
        for i, info in enumerate(proto.training_info)
        for g in (info.initialization, info.algorithm)
    ]

    def attributes(attrs: Iterable[onnx.AttributeProto], where: str, depth: int) -> None:
        for a in attrs:
            at = f"{where} attribute {_show(a.name)}"
            if is_external(a.t) or any(is_external(t) for t in a.tensors):
                found.append(at)
            if _sparse_external(a.sparse_tensor) or any(_sparse_external(s) for s in a.sparse_tensors):
                found.append(at)
            graphs.extend((g, f"{at} subgraph", depth + 1) for g in [a.g, *a.graphs])

    def nodes(ns: Iterable[onnx.NodeProto], where: str, depth: int) -> None:
        for n in ns:
            attributes(n.attribute, f"{where} node {_show(n.name or n.op_type)}", depth)

    for f in proto.functions:
        where = f"function {_show(f.name)}"
        attributes(f.attribute_proto, where, 0)
        nodes(f.node, where, 0)
    while graphs:
        g, where, depth = graphs.pop()
        if depth > MAX_GRAPH_DEPTH:
            raise LoadError(
                f"the ONNX model nests subgraphs more than {MAX_GRAPH_DEPTH} deep ({where})",
                "the file is corrupted or hostile",
            )
        found += [f"{where} initializer {_show(t.name)}" for t in g.initializer if is_external(t)]
        found += [
            f"{where} sparse initializer {_show(s.values.name)}" for s in g.sparse_initializer if _sparse_external(s)
        ]
        nodes(g.node, where, depth)
    return found


def declared_bytes(proto: onnx.ModelProto) -> int:
    """The bytes every tensor of the model declares by its shape and type, wherever it sits (as external_tensors
    searches), inline or external, a sparse one at its dense shape (a runtime may densify it): what a session
    holds, known before one is made, whatever the files take on disk (a data file may be sparse, all holes)."""
    total = 0
    graphs: list[tuple[onnx.GraphProto, int]] = [(proto.graph, 0)]
    graphs += [(g, 0) for info in proto.training_info for g in (info.initialization, info.algorithm)]

    def dense(t: onnx.TensorProto, dims: Any = None) -> int:
        return math.prod(max(int(d), 0) for d in (t.dims if dims is None else dims)) * ITEM_BYTES.get(
            t.data_type, 8
        ) + sum(len(b) for b in t.string_data)

    def sparse(sp: onnx.SparseTensorProto) -> int:
        return dense(sp.values, sp.dims) + dense(sp.values) + dense(sp.indices)

    def attributes(attrs: Any, depth: int) -> int:
        n = 0
        for a in attrs:
            n += (
                (dense(a.t) if a.HasField("t") else 0) + sum(map(dense, a.tensors)) + sum(map(sparse, a.sparse_tensors))
            )
            n += sparse(a.sparse_tensor) if a.HasField("sparse_tensor") else 0
            graphs.extend((g, depth + 1) for g in [a.g, *a.graphs])
        return n

    for f in proto.functions:
        total += attributes(f.attribute_proto, 0) + sum(attributes(n.attribute, 0) for n in f.node)
    while graphs:
        g, depth = graphs.pop()
        if depth > MAX_GRAPH_DEPTH:
            raise LoadError(
                f"the ONNX model nests subgraphs more than {MAX_GRAPH_DEPTH} deep", "the file is corrupted or hostile"
            )
        total += sum(map(dense, g.initializer)) + sum(map(sparse, g.sparse_initializer))
        total += sum(attributes(n.attribute, depth) for n in g.node)
    return total


def external_initializers(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in proto.graph.initializer if is_external(t)]


def point_to(proto: onnx.ModelProto, location: str) -> None:
    """Name `location` as the file of every external initializer (the data was written under another name)."""
    for t in external_initializers(proto):
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = location


def external_bytes(proto: onnx.ModelProto) -> int:
    """The bytes the external initializers name (0 for a self-contained model)."""
    return sum(int(_entries(t, "?").get("length", "0")) for t in external_initializers(proto))


def external_files(proto: onnx.ModelProto) -> list[str]:
    return sorted({_entries(t, "?").get("location", "") for t in external_initializers(proto)})


def written(proto: onnx.ModelProto, onnx_path: Path) -> list[Path]:
    """The files an export of `proto` to `onnx_path` wrote: the model, and its data file when it has one."""
    return [onnx_path, data_path(onnx_path)] if external_initializers(proto) else [onnx_path]


def external_folder(proto: onnx.ModelProto, onnx_path: str | os.PathLike[str] | None) -> Path | None:
    """The folder onnxruntime resolves the external data of `proto` against: the model file's own (None when
    the model is self-contained). The locations must have passed `check_external` (load_onnx, or the export)."""
    if not external_initializers(proto):
        return None
    if onnx_path is None:
        raise LoadError(
            "the ONNX model keeps its weights in an external file, and no model file was named",
            "open it from its .onnx file",
        )
    return Path(onnx_path).resolve().parent


def checked_folder(proto: onnx.ModelProto, onnx_path: str | os.PathLike[str]) -> Path | None:
    """The folder of `onnx_path` once every external tensor of `proto` (read from it) passed check_external;
    None when the model is self-contained."""
    everywhere = external_tensors(proto)
    if not everywhere:
        return None
    check_external(proto, Path(onnx_path), everywhere)
    return Path(onnx_path).resolve().parent


def check_external(proto: onnx.ModelProto, onnx_path: Path, everywhere: list[str]) -> None:
    """LoadError unless every external tensor of `proto` (read from `onnx_path`; `everywhere`: where each
    one sits, anywhere in the model) is a main-graph initializer whose data lies in `onnx_path`.data, at
    the length its shape and type need."""
    own = external_initializers(proto)
    if len(everywhere) != len(own):
        where = next((w for w in everywhere if not w.startswith("graph initializer ")), everywhere[0])
        raise LoadError(
            f"{onnx_path} keeps a tensor in an external file outside the main graph's initializers ({where}); "
            "graphgrow reads external data only for initializers",
            "export it again with graphgrow export",
        )
    try:
        real = onnx_path.resolve(strict=True)  # a link to the model: its data lies beside the file linked to
    except (OSError, RuntimeError) as e:  # RuntimeError: a link loop (Python 3.11)
        raise LoadError(
            f"cannot find where {str(onnx_path)[:120]!r} lies: {first_line(e)}", "open the model file itself"
        ) from None
    root, expected = real.parent, data_path(real).name
    sizes: dict[Path, int] = {}
    for t in own:
        entries = _entries(t, t.name)
        name = f"initializer {t.name[:80]!r}"
        if t.data_location != onnx.TensorProto.EXTERNAL:
            raise LoadError(
                f"{name} has external-data entries but is not marked external", "the file is corrupted or hostile"
            )
        if (
            t.raw_data
            or t.float_data
            or t.int32_data
            or t.int64_data
            or t.double_data
            or t.uint64_data
            or t.string_data
        ):
            raise LoadError(
                f"{name} holds data both inline and in an external file", "the file is corrupted or hostile"
            )
        target = _inside(root, entries.get("location"), expected, name)
        outputs.protect(target)  # an input too: no output of this run replaces it
        size = sizes.setdefault(target, target.stat().st_size)
        offset, length = (_number(entries, k, name) for k in ("offset", "length"))
        need = _tensor_bytes(t, name)
        length = size - (offset or 0) if length is None else length
        if length != need or (offset or 0) + length > size:
            raise LoadError(
                f"{name} needs {need} bytes, its external data gives {length} at offset {offset or 0} of "
                f"{target.name} ({size} bytes)",
                "the file is truncated, corrupted or hostile",
            )


def _entries(t: onnx.TensorProto, name: str) -> dict[str, str]:
    entries: dict[str, str] = {}
    for e in t.external_data:
        if e.key not in KEYS or e.key in entries:
            raise LoadError(
                f"initializer {name[:80]!r} has the external-data entry {e.key[:40]!r}"
                f"{' twice' if e.key in entries else ''}",
                "the file is corrupted or hostile",
            )
        entries[e.key] = e.value
    return entries


def _inside(root: Path, location: str | None, expected: str, name: str) -> Path:
    """The data file, refused unless `location` is `expected` (the model file's name plus .data) and it is a
    regular file in `root` (`root` is resolved already, so only the file itself could be a link)."""
    if location != expected:
        raise LoadError(
            f"{name} names the external file {(location or '')[:80]!r}; graphgrow reads a model's external "
            f"data only from {expected[:80]!r} beside it",
            f"keep the weights in {expected[:80]!r} (graphgrow export writes them so), or export the model again",
        )
    target = root / expected
    try:
        st = os.lstat(target)
    except OSError as e:  # missing, or a name too long for the file system
        raise LoadError(
            f"{name}'s external file {expected[:80]!r} cannot be read beside the model: {e.strerror or e}",
            "keep NAME.onnx.data beside NAME.onnx (move and copy them together)",
        ) from None
    if stat.S_ISLNK(st.st_mode):
        raise LoadError(
            f"{name}'s external file {expected[:80]!r} is a link",
            "graphgrow reads external data only from a regular file beside the model (copy it there)",
        )
    if not stat.S_ISREG(st.st_mode):
        raise LoadError(
            f"{name}'s external file {expected[:80]!r} is not a regular file",
            "keep NAME.onnx.data beside NAME.onnx (move and copy them together)",
        )
    if st.st_nlink > 1:  # a hard link is a link too: the same bytes may be another file of anyone's, anywhere
        raise LoadError(
            f"{name}'s external file {expected[:80]!r} is a hard link ({st.st_nlink} names)",
            "graphgrow reads external data only from a regular file of its own beside the model (copy it there)",
        )
    return target


def _number(entries: dict[str, str], key: str, name: str) -> int | None:
    value = entries.get(key)
    if value is None:
        return None
    if not _DIGITS.fullmatch(value):
        raise LoadError(
            f"{name} has the external-data {key} {value[:40]!r}, which is not a byte count",
            "the file is corrupted or hostile",
        )
    return int(value)


def _tensor_bytes(t: onnx.TensorProto, name: str) -> int:
    item = ITEM_BYTES.get(t.data_type)
    if item is None:
        raise LoadError(
            f"{name} keeps a tensor of type {t.data_type} in external data, which graphgrow does not read",
            "the file is corrupted or hostile",
        )
    if any(d < 0 for d in t.dims):
        raise LoadError(f"{name} has a negative dimension", "the file is corrupted or hostile")
    return int(math.prod(t.dims)) * int(item)


ALIGNMENT = 65536  # bytes: onnxruntime maps (rather than copies) external initializers at aligned offsets
IN_FLIGHT = 256 << 20  # bytes onnx_ir may hold while it writes (its default, 1 GiB, is memory a big export lacks)


@dataclass
class ExternalWrite:
    """The two staged files of an export with external data, renamed into place together (or not at all)."""

    out: Path  # NAME.onnx
    graph: Path  # its staging file
    data: Path  # the staging file of NAME.onnx.data

    @classmethod
    def stage(cls, out: Path) -> ExternalWrite:
        graph = outputs.staging_file(out, "tmp")
        try:
            return cls(out, graph, outputs.staging_file(data_path(out), "tmp"))
        except BaseException:
            outputs.discard(graph)
            raise

    def save(self, model: Any) -> onnx.ModelProto:
        """Write an onnx_ir model's initializers to the staged data file, tensor by tensor; returns the
        graph with its external references (no weights in memory beyond those being written)."""
        import onnx_ir as ir

        try:
            ir.save(model, self.graph, external_data=self.data.name, alignment=ALIGNMENT, max_in_flight_bytes=IN_FLIGHT)
        except OSError as e:
            raise outputs.write_error(self.out, e) from e
        return onnx.load(str(self.graph), load_external_data=False)

    def finish(self, proto: onnx.ModelProto, check: Callable[[str], None]) -> None:
        """Write the final graph, `check` it from the staged files, and rename both into place."""
        from .save import settle

        try:
            point_to(proto, self.data.name)  # the checker reads the data where it is now
            self.graph.write_bytes(proto.SerializeToString())
            check(str(self.graph))
            point_to(proto, data_path(self.out).name)  # what the files say once renamed
            self.graph.write_bytes(proto.SerializeToString())
            settle(self.data)
            settle(self.graph)
        except OSError as e:
            raise outputs.write_error(self.out, e) from e
        outputs.commit([(self.data, data_path(self.out)), (self.graph, self.out)])

    def discard(self) -> None:
        outputs.discard(self.graph)
        outputs.discard(self.data)
