"""Checkpoints read and written a piece at a time: the streaming growth's input and output (jobs/stream_grow.py).

`LazyCheckpoint` reads single tensors, or a range of a tensor's rows, out of a Hugging Face folder's safetensors
(one file or shards with their index) through `safe_open`: each read opens the file, copies the slice out and closes
it again, so no mapping of a multi-GB file stays resident. Every name and shape comes from the headers, which
hf_folder.stored_bytes has checked against the files' sizes before anything is read.

`ShardWriter` writes a new folder the same way save_pretrained does: shards `model-0000K-of-0000N.safetensors`
of at most `shard_bytes` each (a tensor larger than that gets a shard of its own), `model.safetensors.index.json`,
the config, and the companion files carried over untouched. Everything goes into a staging folder beside the
output and is renamed into place at `commit`: a failure, or a signal turned into an exception, leaves no
partial folder, and an existing path is never replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch

from ..core.errors import LoadError, SaveError
from .hf_folder import INDEX, WEIGHTS, companion_files, stored_bytes, weight_files


class LazyCheckpoint:
    """The tensors of a Hugging Face folder, by name, read one at a time (module docstring)."""

    def __init__(self, folder: Path, files: list[Path] | None = None) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        self.files = weight_files(self.folder) if files is None else list(files)
        stored_bytes(self.files)  # headers bounded and well-formed before any tensor is read
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in self.files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                    self.where[name] = f
                    self.shapes[name] = tuple(fh.get_slice(name).get_shape())

    @classmethod
    def of_files(cls, files: list[Path]) -> LazyCheckpoint:
        """The tensors of these safetensors files (a staging folder's shards)."""
        return cls(Path(files[0]).parent if files else Path("."), files)

    def tensor(self, name: str) -> torch.Tensor:
        return self.rows(name, 0, None)

    def rows(self, name: str, start: int, stop: int | None) -> torch.Tensor:
        """Rows start:stop of tensor `name` (stop None: to the end), as a tensor of its own."""
        from safetensors import safe_open

        if name not in self.where:
            raise LoadError(f"{self.folder} has no tensor {name!r}", "check that the folder is complete")
        with safe_open(str(self.where[name]), framework="pt") as fh:
            piece = fh.get_slice(name)
            t: torch.Tensor = piece[start:stop] if len(self.shapes[name]) else piece[:]
            return t.clone()  # its own storage: nothing of the file stays mapped


_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
}


class RowSink:
    """One tensor written into a shard of its own a block of rows at a time: the header (its name, dtype, shape)
    is written first, the rows follow in order; `close` checks that exactly the declared bytes arrived."""

    def __init__(self, path: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.name, self.dtype, self.row_shape = name, dtype, tuple(shape[1:])
        self.nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
        header = {"__metadata__": {"format": "pt"}, name: {"dtype": _ST_DTYPES[dtype], "shape": list(shape)}}
        header[name]["data_offsets"] = [0, self.nbytes]
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.file = path.open("wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.written = 0

    def write(self, rows: torch.Tensor) -> None:
        if tuple(rows.shape[1:]) != self.row_shape or rows.dtype != self.dtype:
            raise SaveError(
                f"rows of {self.name} are {rows.dtype} {tuple(rows.shape)}, not {self.dtype} (n, {self.row_shape})",
                "report this: it is a bug in the streaming",
            )
        data = rows.detach().contiguous().view(torch.uint8).numpy().tobytes()
        self.file.write(data)
        self.written += len(data)

    def close(self) -> None:
        self.file.close()
        if self.written != self.nbytes:
            raise SaveError(
                f"{self.name} got {self.written:,} of its {self.nbytes:,} bytes", "report this: it is a bug"
            )


class ShardWriter:
    """A new model folder written tensor by tensor (module docstring). Use as a context manager: leaving it
    without `commit` removes everything it wrote."""

    def __init__(self, final: Path, shard_bytes: int = 1 << 30) -> None:
        self.final = Path(final)
        if self.final.exists():
            raise SaveError(
                f"{self.final} exists: a model folder is written to a new name, never over an existing one",
                "give -o a folder name that does not exist yet",
            )
        parent = self.final.parent if str(self.final.parent) else Path(".")
        try:
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name[:100]}.ggdir-", dir=parent))
        except OSError as e:
            raise SaveError(f"cannot write into {parent}: {e.strerror or e}", "choose another output folder") from e
        self.shard_bytes = shard_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.total = 0
        self.names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise SaveError(f"the output would hold {name!r} twice", "report this: it is a bug in the streaming plan")
        self.names.add(name)
        size = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffered + size > self.shard_bytes:
            self.flush()
        self.buffer[name] = tensor.contiguous()
        self.buffered += size
        self.total += size

    def rows(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> RowSink:
        """A tensor too large to hold at once (embeddings, LM head): a shard of its own, written by rows."""
        if name in self.names:
            raise SaveError(f"the output would hold {name!r} twice", "report this: it is a bug in the streaming plan")
        self.names.add(name)
        path = self.tmp / f"shard-{len(self.shards):05d}.part"
        sink = RowSink(path, name, shape, dtype)
        self.shards.append((path, [name]))
        self.total += sink.nbytes
        return sink

    def flush(self) -> None:
        if not self.buffer:
            return
        from safetensors.torch import save_file

        path = self.tmp / f"shard-{len(self.shards):05d}.part"
        try:
            save_file(self.buffer, str(path), metadata={"format": "pt"})
        except OSError as e:
            raise SaveError(f"cannot write {self.final}: {e.strerror or e}", "check the free space") from e
        self.shards.append((path, list(self.buffer)))
        self.buffer, self.buffered = {}, 0

    def commit(self, config: dict[str, Any], source: Path | None = None) -> Path:
        """Write the last shard, the index and `config` (config.json), carry `source`'s companion files, then
        rename the staging folder into place."""
        self.flush()
        n = len(self.shards)
        weight_map = {}
        try:
            for k, (path, names) in enumerate(self.shards):
                name = WEIGHTS if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
                os.rename(path, self.tmp / name)
                weight_map.update(dict.fromkeys(names, name))
            if n > 1:
                index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
                (self.tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
            (self.tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            for f in companion_files(source) if source is not None else []:
                shutil.copy2(f, self.tmp / f.name)  # the tokenizer and generation settings, as the user had them
            if self.final.exists():
                raise SaveError(f"{self.final} appeared while it was written", "give -o a new folder name")
            os.rename(self.tmp, self.final)
        except OSError as e:
            raise SaveError(
                f"cannot write {self.final}: {e.strerror or e}", "check the folder and the free space"
            ) from e
        return self.final

    def discard(self) -> None:
        self.buffer = {}
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: Any) -> Literal[False]:
        if self.tmp.exists():
            self.discard()
        return False
