"""How outputs reach the disk (architecture.md §7): staging files, renames that a signal cannot split, and
write errors as one-line refusals.

Every output is written to a hidden staging file beside it and renamed into place. A staging
file's name says who wrote it — `.NAME.gg-PID-START-HOST-XXXXXXXX.part` (or `.tmp`, `.probe`):
the writer's pid, its start time (so a reused pid is not mistaken for it) and a key of the
machine and pid namespace — so that the next run writing to the folder removes those of a killed
run, keeps those of a run still alive, and touches nothing else.

No output replaces an input (`protect` records each file read, by device and inode, so a link or a
hard link to it is caught too) or anything but a regular file (`check_replaceable`, at the check before
the work and again before the renames); a name graphgrow chooses itself is claimed when the output
is renamed into place, never one another run took meanwhile (`claim`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import re
import signal
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from ..core.errors import SaveError, first_line

WAY_OUT = "check free space, quota, the file-size limit (ulimit -f) and permissions, or choose another output path"

_STAGING = re.compile(r"\..*\.gg-([1-9]\d{0,9})-(\d{1,20})-([0-9a-f]{12})-[a-z0-9_]{8}\.(?:part|tmp|probe)", re.S)
_NAME_BYTES = 60  # of the output's name kept in a staging name: a long output name must not make it too long

_own: dict[Path, Path] = {}  # this process's staging files → the output each stands for
_committed: list[Path] = []  # outputs this process renamed into place (the CLI names them when a signal ends it)
_swept: set[str] = set()  # folders already cleaned by this process
_inputs: dict[tuple[int, int], str] = {}  # (device, inode) of each file this process read as an input → its name


def is_staging_name(name: str) -> bool:
    """Whether `name` is spelled like a graphgrow staging file (whoever wrote it)."""
    return _STAGING.fullmatch(name) is not None


def is_own_staging(path: Path) -> bool:
    return Path(path) in _own


def output_of(path: Path) -> Path:
    """The output a staging file of this process stands for (`path` itself when it is not one)."""
    return _own.get(Path(path), Path(path))


def committed() -> list[Path]:
    """The outputs renamed into place so far in this process."""
    return list(_committed)


def forget_committed() -> None:
    """A new command starts (the CLI runs one per process; tests run many): its inputs are its own."""
    _committed.clear()
    _inputs.clear()


def protect(path: str | os.PathLike[str]) -> None:
    """`path` is read as an input: no output of this process may replace it, under whatever name reaches it."""
    try:
        st = os.stat(path)
    except OSError:
        return  # nothing there: nothing to protect (the reader reports it)
    _inputs[(st.st_dev, st.st_ino)] = os.fspath(path)


def input_named_by(path: str | os.PathLike[str], inputs: Sequence[str | os.PathLike[str]] = ()) -> str | None:
    """The input file (one of `inputs`, or one `protect`ed) that `path` reaches, by device and inode: through a
    symlink, a hard link or another spelling; None when it reaches none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (st.st_dev, st.st_ino)
    for src in inputs:
        try:
            other = os.stat(src)
        except (OSError, ValueError):
            continue  # a factory name, or a file not there
        if (other.st_dev, other.st_ino) == key:
            return os.fspath(src)
    name = _inputs.get(key)
    if name is not None:
        try:  # still that file: an input deleted since, its inode reused by a new file, is no longer an input
            again = os.stat(name)
        except OSError:
            return None
        if (again.st_dev, again.st_ino) != key:
            return None
    return name


def check_replaceable(path: Path, inputs: Sequence[str | os.PathLike[str]] = ()) -> None:
    """Refuse (SaveError) an output `path` that exists and is not a regular file — a symlink (even to a
    file), a directory, a device, a fifo, a socket — or that is an input (`input_named_by`)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # a new name
    if stat.S_ISLNK(st.st_mode):
        raise SaveError(
            f"output {path} is a symbolic link; graphgrow replaces only regular files, never a link",
            "name the file itself, or a new name",
        )
    if stat.S_ISDIR(st.st_mode):
        raise SaveError(f"output {path} is a directory", "give a file name, e.g. grown.pt")
    if not stat.S_ISREG(st.st_mode):
        raise SaveError(
            f"output {path} is not a regular file (a device, pipe or socket); graphgrow only writes files",
            "choose a file name",
        )
    source = input_named_by(path, inputs)
    if source is not None:
        same = (
            "the input file"
            if os.path.abspath(source) == os.path.abspath(path)
            else f"the input file {source} (the same file under another name)"
        )
        raise SaveError(f"output {path} is {same}", "graphgrow never overwrites its input; choose another -o")


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of `pid` from /proc; None when /proc has no such entry."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
        fields = data[data.rindex(b")") + 2 :].split()  # after the command name, which may hold spaces
        return fields[0].decode(), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


@functools.cache
def _start() -> int:
    found = _proc_stat(os.getpid())
    return found[1] if found else 0


@functools.cache
def _host_key() -> str:
    """This machine (boot id, host name) and pid namespace: a pid means this process only here."""
    parts = [socket.gethostname()]
    reads: tuple[Callable[[], str], ...] = (
        lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        lambda: str(os.stat("/proc/self/ns/pid").st_ino),
    )
    for read in reads:
        try:
            parts.append(read())
        except OSError:
            parts.append("")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def _alive(pid: int, start: int) -> bool:
    """Whether the writer `pid` (started at `start`) may still run; when unsure, alive."""
    found = _proc_stat(pid)
    if found is not None:
        state, now = found
        return state not in ("Z", "X") and (start == 0 or now == start)  # a zombie writes nothing more
    if _start():
        return False  # /proc works (it gave this process's start) and has no such process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # another user's process (EPERM), or a pid that cannot be asked about
    return True


def sweep(folder: Path) -> list[Path]:
    """Remove from `folder` the staging files that killed graphgrow runs on this machine left (once per
    process and folder). Only regular files of this user, spelled as staging files, whose writer is
    gone; never one of a live process or of another machine, never anything else. Returns what went."""
    where = os.path.abspath(folder)
    if where in _swept:
        return []
    _swept.add(where)
    removed: list[Path] = []
    try:
        entries = list(os.scandir(where))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(".") or ".gg-" not in entry.name:
            continue
        m = _STAGING.fullmatch(entry.name)
        if m is None or m.group(3) != _host_key() or _alive(int(m.group(1)), int(m.group(2))):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            os.unlink(entry.path)
            removed.append(Path(entry.path))
        except OSError:
            continue  # gone already, or not ours to remove
    return removed


def staging_file(final: Path, kind: str = "part") -> Path:
    """Create an empty staging file for `final` in its folder (after sweeping the folder); raises OSError."""
    final = Path(final)
    folder = final.parent if str(final.parent) else Path(".")
    sweep(folder)
    short = os.fsdecode(os.fsencode(final.name)[:_NAME_BYTES])
    fd, name = tempfile.mkstemp(
        prefix=f".{short}.gg-{os.getpid()}-{_start()}-{_host_key()}-", suffix=f".{kind}", dir=folder
    )
    try:  # known (discard_all) before anything else can happen, a signal included
        _own[Path(name)] = output_of(final)  # a staging file of a staging file stands for the same output
        os.close(fd)
    except BaseException:
        discard(Path(name))
        raise
    return Path(name)


def forget(path: Path) -> None:
    """`path` (a staging file of this process) is gone: removed or renamed."""
    _own.pop(Path(path), None)


def discard(path: Path) -> None:
    Path(path).unlink(missing_ok=True)
    forget(path)


def discard_all() -> None:
    """Remove every staging file this process still has (the CLI, as a command ends: a signal may have
    come between creating one and handing it to whoever cleans it up)."""
    for path in list(_own):
        with contextlib.suppress(OSError):
            discard(path)


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP wait while the body runs and are delivered when it ends, so that
    renaming several outputs into place is not cut in the middle (all outputs or none)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can be set from the main thread only; Python runs them there too
        return
    pending: list[int] = []
    old: dict[int, Any] = {}
    holding = True

    def hold(signum: int, frame: Any) -> None:
        if holding:
            pending.append(signum)
        else:  # left installed by an exception while the handlers were being restored: pass the signal on
            signal.signal(signum, old[signum])
            signal.raise_signal(signum)

    try:
        for sig in (getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n)):
            previous = signal.signal(sig, hold)
            old[sig] = signal.SIG_DFL if previous is None else previous  # None: a handler not set from Python
        yield
    finally:
        holding = False
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):
            signal.raise_signal(sig)


def fresh_names(first: Path) -> Iterator[Path]:
    """NAME.SUFFIX, then NAME-1.SUFFIX, NAME-2.SUFFIX, ...: the names a default output may take."""
    yield first
    i = 1
    while True:
        yield first.with_name(f"{first.stem}-{i}{first.suffix}")
        i += 1


def claim(tmp: Path, first: Path) -> Path:
    """Put the staged `tmp` under the first of `fresh_names(first)` that nothing has, atomically: a hard link
    fails when the name exists (as O_EXCL does), so two runs never take one name and none is replaced.
    Where the file system has no hard links, the name is created with O_CREAT|O_EXCL and `tmp` renamed onto it."""
    for name in fresh_names(first):
        try:
            os.link(tmp, name)
        except FileExistsError:
            continue
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                raise
            try:
                os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                continue
            os.replace(tmp, name)
            return name
        os.unlink(tmp)
        return name
    raise AssertionError("unreachable")


def commit(pairs: Sequence[tuple[Path, Path]], fresh: Mapping[Path, Path] | None = None) -> list[Path]:
    """Rename each staged file onto its final path, signals held until all are in place; a final in `fresh`
    (a name graphgrow chose) goes to the first free name from `fresh[final]` on (`claim`). Every final is checked first
    (`check_replaceable`): none is renamed when one cannot be. A rename that fails is SaveError naming its output."""
    fresh = fresh or {}
    for _, final in pairs:
        if not is_own_staging(final) and final not in fresh:  # a claimed name replaces nothing
            check_replaceable(final)
    done = []
    with held_signals():
        for tmp, final in pairs:
            try:
                if final in fresh:
                    final = claim(tmp, fresh[final])
                else:
                    os.replace(tmp, final)
            except OSError as e:
                raise write_error(final, e) from e
            forget(tmp)
            done.append(Path(final))
            if not is_own_staging(final):  # filling a staging file is not an output yet
                _committed.append(Path(final))
    return done


# What torch's zip writer says when a write failed (it swallows the OSError: ulimit -f gave
# "[enforce fail at inline_container.cc:672] . unexpected pos 6208 vs 6128").
_TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")


def is_write_error(e: BaseException) -> bool:
    return isinstance(e, OSError) or (isinstance(e, RuntimeError) and any(s in str(e) for s in _TORCH_WRITE_FAILED))


def write_error(path: Path, e: BaseException) -> SaveError:
    """`cannot write OUT: reason` for a write that failed (OUT the user's output, also for a staging file)."""
    if isinstance(e, OSError):
        reason = e.strerror or first_line(e, 200)
    else:
        reason = f"the write stopped part-way ({first_line(e, 120)})"
    return SaveError(f"cannot write {output_of(path)}: {reason}", WAY_OUT)


class _Recorder:
    """The file torch.save writes through, keeping the OSError a write raised (torch's zip writer turns
    it into a RuntimeError without the reason)."""

    def __init__(self, f: IO[bytes], name: str):
        self.f, self.name = f, name
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def torch_save(obj: Any, path: Path) -> None:
    """torch.save(obj, path), raising the OSError of a failed write (EFBIG, ENOSPC, EDQUOT, EIO) itself."""
    import torch

    with open(path, "wb") as f:
        recorder = _Recorder(f, str(path))
        try:
            torch.save(obj, recorder)
        except RuntimeError as e:
            if recorder.error is not None:
                raise recorder.error from e
            raise
