"""Writing outputs whole: a model file in the safe format (save_model), any file through a staging file and a
rename (atomic_write), outputs refused before work starts (check_output_path), and default output names."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from torch import fx

from ..core.errors import SaveError, first_line
from . import serialize
from .factory import is_factory_name


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a staging file in the same folder and rename: the old file or the new, never half.
    A failed write (disk full, quota, file-size limit, read-only, permission) is SaveError naming the output."""
    from . import outputs

    path = Path(path)
    try:
        tmp_path = outputs.staging_file(path, "tmp")
    except OSError as e:
        raise outputs.write_error(path, e) from e
    try:
        write(tmp_path)
        settle(tmp_path)
        outputs.commit([(tmp_path, path)])
    except BaseException as e:
        outputs.discard(tmp_path)
        if outputs.is_write_error(e):
            raise outputs.write_error(path, e) from e
        raise


def settle(staged: Path) -> None:
    """A staged file on the disk for good (fsync), with the modes any new file gets (mkstemp makes 0600)."""
    with open(staged, "rb+") as f:
        os.fsync(f.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staged, 0o666 & ~umask)


def check_output_path(path: str | os.PathLike[str], inputs: tuple[str | os.PathLike[str], ...] = ()) -> Path:
    """Refuse outputs over an input, into missing or read-only folders, or spelled like another run's
    staging file (the next run would remove it). Returns the path."""
    out = Path(path)
    try:
        return _checked_output(out, inputs)
    except OSError as e:  # a name too long for the file system, a link loop, an unreadable folder
        raise SaveError(
            f"output {str(out)[:200]!r} cannot be written: {e.strerror or first_line(e)}", "choose another output path"
        ) from None


def _checked_output(out: Path, inputs: tuple[str | os.PathLike[str], ...]) -> Path:
    from . import outputs

    if outputs.is_staging_name(out.name) and not outputs.is_own_staging(out):
        raise SaveError(
            f"output {out} is named like a graphgrow staging file (.NAME.gg-PID-….part), which a later run may remove",
            "choose another output name",
        )
    outputs.check_replaceable(out, [str(src) for src in inputs if src])  # a new name, or a regular file no input
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        what = "is a file, not a folder" if parent.exists() else "does not exist"
        raise SaveError(f"folder {parent} {what}", "create it first or choose another output path")
    try:  # a real probe: permission bits alone mislead (root, read-only mounts); stale staging files go too
        outputs.discard(outputs.staging_file(out, "probe"))
    except OSError as e:
        raise SaveError(f"folder {parent} is not writable ({e.strerror or e})", "choose another output path") from e
    return out


def save_model(
    gm: fx.GraphModule, path: str | os.PathLike[str], inputs: tuple[str | os.PathLike[str], ...] = ()
) -> Path:
    """Save a graphgrow GraphModule atomically in the safe format; returns the path. A failed write is SaveError."""
    from .outputs import torch_save

    out = check_output_path(path, inputs)
    payload = serialize.to_payload(gm)
    atomic_write(out, lambda tmp: torch_save(payload, tmp))
    return out


def plain_output_path(source: str, suffix: str = ".grown.pt") -> Path:
    """NAME`suffix` beside the input (in the working directory for factory names)."""
    if is_factory_name(source):
        from .zoo import parse_name

        base = Path.cwd() / parse_name(source).short
    else:
        p = Path(source)
        base = p.with_name(p.name.split(".")[0] if not p.name.startswith(".") else p.name)
    return base.with_name(base.name + suffix)


def default_output_path(source: str, suffix: str = ".grown.pt") -> Path:
    """Beside the input under a new name (never the input itself, never an earlier result):
    NAME.grown.pt, else NAME.grown-1.pt, NAME.grown-2.pt, ... — the first free one now. Another run may take
    it before this one writes: the output is claimed when written (outputs.commit with `fresh`, outputs.claim)."""
    from . import outputs

    for candidate in outputs.fresh_names(plain_output_path(source, suffix)):
        if not os.path.lexists(candidate):
            return candidate
    raise AssertionError("unreachable")
