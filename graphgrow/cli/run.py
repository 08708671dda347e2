"""Running one command: the consoles, one-line errors with exit codes, signals and staged outputs.

Exit codes: 0 success; 1 a check failed; 2 bad input or a pass that cannot apply (GraphgrowError's own code);
3 an internal error (a bug). A signal (Ctrl-C, SIGTERM, SIGHUP) discards staged outputs and says which
outputs were complete; the exit code is then 128 + the signal. Standard output that cannot be written is not a
bug: a reader that went away (`graphgrow inspect M | head`) ends the command quietly with 141 (128 + SIGPIPE,
what the shell shows for a tool SIGPIPE ended); any other failure (a full disk: `--json > /dev/full`) is exit 2
with one line naming it and any outputs already written.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape

from ..core.errors import GraphgrowError, SpecError, first_line
from .safe_text import printable

out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, soft_wrap=True)

MAX_MESSAGE = 500  # user-supplied text in messages is cut: a 2 MB argument is not echoed whole


def cut(text: str) -> str:
    text = printable(" ".join(text.split()))  # names from files may hold terminal escapes
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + f"… ({len(text) - MAX_MESSAGE:,} more characters)"


@contextlib.contextmanager
def _progress():
    """A spinner on stderr for long steps (export takes seconds to a minute)."""
    with err.status("starting", spinner="dots") as status:
        yield lambda msg: status.update(msg)


class _Signalled(KeyboardInterrupt):
    """SIGTERM/SIGHUP as an exception, so staged outputs and temp files are cleaned up as on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_received: list[int] = []  # signals seen: C extensions (an import mid-flight) may turn our exception into another
_exit_code: list[int] = []  # once the command's exit code is decided (outputs and report written)


def _raise_signal(signum, frame) -> None:
    if _exit_code:  # the command is done and said so: a late signal ends the process now, with the command's code
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(_exit_code[0])
    _received.append(signum)
    raise _Signalled(signum)


def _ignore_late_signals() -> None:
    """At interpreter exit (atexit), after the command has finished: Python stops running its signal
    handlers while it tears down (seconds with torch loaded), so a signal then would kill the process
    with no message and no exit code of the command's (128 + signal): ignored instead."""
    if _exit_code:
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            with contextlib.suppress(AttributeError, ValueError, OSError):
                signal.signal(getattr(signal, name), signal.SIG_IGN)


def _exit(code: int) -> None:
    from ..io.outputs import discard_all

    discard_all()  # no staging file outlives the command, whatever stopped it
    _exit_code[:] = [code]
    sys.exit(code)


def _interrupted(signum: int) -> None:
    from ..io.outputs import committed

    name = signal.Signals(signum).name
    written = committed()  # renamed into place before the signal came: whole, and staying
    if written:
        err.print(
            f"interrupted ({name}) after writing {cut(', '.join(map(str, written)))}: these outputs are complete",
            markup=False,
            highlight=False,
        )
    else:
        err.print(f"interrupted ({name}); nothing was written or overwritten", markup=False)
    _exit(128 + signum)


class _StdoutFailed(Exception):
    """Writing to standard output failed (a closed pipe, a full disk): the user's setup, not a bug."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


class _GuardedStdout:
    """sys.stdout while a command runs (print and the rich console both write through it): a failed write
    is _StdoutFailed, told apart from the OSErrors of the command's own files."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise _StdoutFailed(e) from e

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise _StdoutFailed(e) from e

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _stdout_failed(e: OSError) -> None:
    """Standard output cannot take the report: what is still buffered goes nowhere (os.devnull on fd 1, so
    Python's own flush at exit fails no more), then exit 141 quietly for a closed pipe, else exit 2 naming it."""
    from ..io.outputs import committed

    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.__stdout__.fileno())  # type: ignore[union-attr]
        os.close(fd)
    if e.errno == errno.EPIPE:
        _exit(128 + signal.SIGPIPE)
    written = committed()
    done = f"; the outputs were written whole: {cut(', '.join(map(str, written)))}" if written else ""
    err.print(
        f"error: cannot write to standard output: {e.strerror or first_line(e)}{done} "
        "(check where standard output goes: free space, a closed pipe or terminal)",
        markup=False,
        highlight=False,
    )
    _exit(2)


def run_command(job: Callable[[Callable[[str], None]], int], as_json: bool, debug: bool) -> None:
    real = sys.stdout
    sys.stdout = _GuardedStdout(real)  # type: ignore[assignment]
    try:
        try:
            _run_command(job, as_json, debug)
        except _StdoutFailed as e:  # the report, or the JSON of an error, could not be printed
            _stdout_failed(e.error)
    finally:
        sys.stdout = real


def _run_command(job: Callable[[Callable[[str], None]], int], as_json: bool, debug: bool) -> None:
    from ..io.outputs import forget_committed

    _received.clear()
    _exit_code.clear()
    forget_committed()
    atexit.unregister(_ignore_late_signals)  # once, however many commands a process runs (tests)
    atexit.register(_ignore_late_signals)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_signal)
    if hasattr(signal, "SIGXFSZ"):  # past `ulimit -f` a write fails with EFBIG (exit 2) instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        with _progress() as progress:
            code = job(progress)
        sys.stdout.flush()  # a report that cannot be written fails here, not at the interpreter's exit
    except _StdoutFailed:
        raise
    except GraphgrowError as e:
        if _received:  # the signal surfaced wrapped in one of our errors
            _interrupted(_received[0])
        if debug:
            traceback.print_exc()
        err.print("[bold red]error:[/] " + escape(cut(GraphgrowError.__str__(e))), markup=True, highlight=False)
        pointer = e.pointer() if isinstance(e, SpecError) else ""
        if pointer:  # the spec with a caret under the problem: printed as is (_cut would fold its spacing)
            err.print(pointer, markup=False, highlight=False)
        if as_json:
            print(json.dumps({"error": {"type": type(e).__name__, "message": e.message, "hint": e.hint}}))
        _exit(e.exit_code)
    except KeyboardInterrupt as e:
        _interrupted(e.signum if isinstance(e, _Signalled) else signal.SIGINT)
    except Exception as e:  # a bug in graphgrow: still one line unless --debug
        if _received:
            _interrupted(_received[0])
        if debug:
            traceback.print_exc()
        first = escape(cut(first_line(e, MAX_MESSAGE)))
        err.print(
            f"[bold red]internal error:[/] {type(e).__name__}: {first} "
            "(run with --debug for the traceback and please report it)",
            markup=True,
            highlight=False,
        )
        _exit(3)
    _exit(code)
