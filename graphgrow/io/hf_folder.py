"""A Hugging Face model folder as a source: `config.json` plus safetensors weights (one file or shards with their
index), as `save_pretrained` writes it. The class is the config's own (`architectures[0]`, a class transformers
ships; never remote code: a config with `auto_map` is refused), built from the config and filled by
`from_pretrained` from the local folder only (`local_files_only`, `use_safetensors`): a pickled `pytorch_model.bin`
is never read. The weights' size is read from the safetensors headers and checked against `--max-load` before
anything is allocated. The cache is turned off while the model is captured (torch.export cannot capture a
DynamicCache); the native result gets the folder's own setting back (jobs/native.py).
A bfloat16 or float16 folder loads and grows in its own
dtype (verify.low_precision compares in float32, node by node); the native result is written in it again.

Files beside the weights that describe how to use the model (tokenizer, generation config, chat template, README)
are listed by `companion_files`; `write_folder` writes a model with `save_pretrained` (safetensors) into a staging
folder beside the output, carries those files over untouched, and renames the folder into place at the end: a
failure leaves no partial folder, and an existing path is never replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..core.errors import LoadError, SaveError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
MAX_CONFIG_BYTES = 4 << 20  # a config.json is a few kB; a larger one is not read
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its JSON header
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_NOT_COMPANIONS = {"config.json", WEIGHTS, INDEX, *PICKLED}


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_config(folder: Path) -> dict[str, Any]:
    f = folder / "config.json"
    if f.stat().st_size > MAX_CONFIG_BYTES:
        raise LoadError(f"{f} is {f.stat().st_size:,} bytes: not a model config", "check the folder")
    try:
        config = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{f} is not valid JSON: {e}", "save the model again with save_pretrained") from e
    if not isinstance(config, dict):
        raise LoadError(
            f"{f} holds {type(config).__name__}, not a config object", "save the model again with save_pretrained"
        )
    if "auto_map" in config:
        raise LoadError(
            f"{folder} needs remote code (its config has auto_map): graphgrow never runs code from a model folder",
            "use a model class transformers ships",
        )
    return config


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the folder (one, or the shards its index names); LoadError when there are none."""
    if (folder / INDEX).is_file():
        try:
            index = json.loads((folder / INDEX).read_text())
            names = sorted(set(index["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise LoadError(
                f"{folder / INDEX} is not a safetensors index: {e}", "save the model again with save_pretrained"
            ) from e
        files = [folder / n for n in names]
        bad = [n for n, f in zip(names, files) if Path(n).name != n or not f.is_file()]
        if bad:
            raise LoadError(
                f"{folder / INDEX} names shards that are not files in the folder: {', '.join(bad[:3])}",
                "copy the whole folder save_pretrained wrote",
            )
        return files
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    pickled = [p for p in PICKLED if (folder / p).exists()]
    if pickled:
        raise LoadError(
            f"{folder} holds its weights as {pickled[0]}, which graphgrow does not read (pickled files can run code)",
            "convert it once where you trust it: model.save_pretrained(folder, safe_serialization=True)",
        )
    raise LoadError(f"{folder} has a config.json but no {WEIGHTS} or {INDEX}", "save the model with save_pretrained")


def stored_bytes(files: list[Path]) -> tuple[int, int, set[str]]:
    """(bytes the tensors take, number of values, dtypes) from the safetensors headers: nothing is allocated."""
    total, count, dtypes = 0, 0, set()
    for f in files:
        with f.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise LoadError(
                    f"{f} is not a safetensors file (too short)", "save the model again with save_pretrained"
                )
            n = struct.unpack("<Q", raw)[0]
            if n > MAX_HEADER_BYTES or n > f.stat().st_size:
                raise LoadError(
                    f"{f} is not a safetensors file (a header of {n:,} bytes)",
                    "save the model again with save_pretrained",
                )
            try:
                header = json.loads(fh.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise LoadError(
                    f"{f} is not a safetensors file: {e}", "save the model again with save_pretrained"
                ) from e
        for key, info in header.items():
            if key == "__metadata__" or not isinstance(info, dict):
                continue
            numel = 1
            for s in info.get("shape", []):
                numel *= int(s)
            dtypes.add(str(info.get("dtype")))
            total += numel * _DTYPE_BYTES.get(str(info.get("dtype")), 8)
            count += numel
    return total, count, dtypes


def model_class(folder: Path, config: dict[str, Any]) -> Any:
    import transformers

    names = config.get("architectures") or []
    if not names:
        raise LoadError(
            f"{folder}/config.json names no architectures: graphgrow cannot tell which class to build",
            "save the model with save_pretrained (it writes architectures), or build it by name: hf:TYPE/TASK",
        )
    cls = getattr(transformers, str(names[0]), None)
    if not isinstance(cls, type) or not hasattr(cls, "from_pretrained"):
        raise LoadError(
            f"{folder}: transformers {transformers.__version__} has no class {str(names[0])[:80]!r}",
            "use a transformers version that ships it; remote code is never run",
        )
    return cls


def load_folder(folder: Path, max_bytes: int) -> tuple[Any, torch.dtype, bool | None]:
    """The model of the folder in eval mode — in its bfloat16 or float16 when every float tensor is stored so, else
    in float32 —, the dtype its weights are stored in, and the folder's own use_cache (None when its config has none;
    the native result gets it back)."""
    config = read_config(folder)
    files = weight_files(folder)
    cls = model_class(folder, config)
    stored, count, dtypes = stored_bytes(files)
    floats = {d for d in dtypes if d in ("F32", "F16", "BF16", "F64")}
    stored_dtype = (
        {"BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}.get(next(iter(floats)), torch.float32)
        if len(floats) == 1
        else torch.float32
    )
    dtype = stored_dtype if stored_dtype in (torch.bfloat16, torch.float16) else torch.float32
    loaded = stored if dtypes <= {"F32"} or dtype != torch.float32 else count * 4
    if loaded > max_bytes:
        raise LoadError(
            f"{folder} holds {count:,} values ({stored / 2**20:,.1f} MiB stored, {loaded / 2**20:,.1f} MiB "
            f"loaded in {str(dtype).removeprefix('torch.')}, limit {max_bytes / 2**20:,.1f} MiB); "
            "nothing was allocated",
            "raise the limit with --max-load SIZE",
        )
    from .zoo import sealed_caches

    with sealed_caches():
        try:
            model = cls.from_pretrained(
                str(folder), local_files_only=True, use_safetensors=True, trust_remote_code=False, dtype=dtype
            )  # the cache is turned off while it is captured
        except LoadError:
            raise
        except Exception as e:
            raise LoadError(
                f"{folder}: {cls.__name__}.from_pretrained failed: {type(e).__name__}: {str(e)[:300]}",
                "check that the folder is complete (config.json and every shard)",
            ) from e
    return model.eval(), stored_dtype, (bool(config["use_cache"]) if "use_cache" in config else None)


def companion_files(folder: Path) -> list[Path]:
    """Plain files of the folder that are neither the config nor weights (tokenizer, generation config, chat
    template, README): carried to an output folder as they are."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file()
        and p.name not in _NOT_COMPANIONS
        and not p.name.endswith(".safetensors")
        and not p.name.startswith(".")
    )


def check_new_folder(out: Path) -> None:
    """A model folder output (a name without .pt) must be new: checked before the model is loaded."""
    if out.suffix not in (".pt", ".pth") and out.exists():
        raise SaveError(
            f"{out} exists: a grown model folder is written to a new name, never over an existing path",
            "give -o a folder name that does not exist yet (or NAME.pt for graphgrow's own file)",
        )


def write_folder(model: Any, final: Path, source: Path | None = None) -> Path:
    """`model.save_pretrained` into a new folder `final`, with the companion files of `source` (module docstring)."""
    final = Path(final)
    if final.exists():
        raise SaveError(
            f"{final} exists: a model folder is written to a new name, never over an existing one",
            "give -o a folder name that does not exist yet",
        )
    parent = final.parent if str(final.parent) else Path(".")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name[:100]}.ggdir-", dir=parent))
    except OSError as e:
        raise SaveError(f"cannot write into {parent}: {e.strerror or e}", "choose another output folder") from e
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        for f in companion_files(source) if source is not None else []:
            shutil.copy2(f, tmp / f.name)  # the tokenizer and generation settings, as the user had them
        os.rename(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise SaveError(f"cannot write {final}: {e.strerror or e}", "check the folder and the free space") from e
        if isinstance(e, Exception) and not isinstance(e, SaveError):
            raise SaveError(
                f"{type(model).__name__}.save_pretrained failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
                "write graphgrow's own file instead: -o NAME.pt",
            ) from e
        raise
    return final
