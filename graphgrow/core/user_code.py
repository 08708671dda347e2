"""Calling the user's code (a factory, a `--data` function and its loss, importing their module) so that it
cannot end graphgrow silently nor corrupt its output.

Inside `calling(...)`:
- what the code prints goes to stderr: stdout carries only graphgrow's report (`--json` stays one JSON object);
- anything it raises becomes one typed error (exit 2 in the CLI) naming the code and what it raised — also the
  BaseExceptions a library would let through: `sys.exit(0)` (SystemExit), GeneratorExit, a BaseException
  subclass of its own, and a KeyboardInterrupt it raises itself;
- two things pass as they are: graphgrow's own exceptions raised inside the call (a refusal of the allocation
  guard, a LoadError of a nested import: they already say what went wrong), and a real Ctrl-C — a SIGINT that
  arrived while the code ran — which still stops the command (the CLI says "interrupted").
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .errors import GraphgrowError, InputError

_sigints = [0]  # SIGINTs delivered while user code ran (any depth): tells a real Ctrl-C from a raised one


@contextlib.contextmanager
def _counting_sigint() -> Iterator[None]:
    """Count SIGINTs while the block runs, handing each on to the handler that was there. Only the main thread
    can set handlers; elsewhere (and under a handler graphgrow cannot call) nothing is counted, so every
    KeyboardInterrupt there counts as a real Ctrl-C: the safe side."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN / SIG_DFL / None: not ours to wrap
        yield
        return

    def note(signum: int, frame: Any) -> None:
        _sigints[0] += 1
        previous(signum, frame)

    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _graphgrows_own(e: BaseException) -> bool:
    return isinstance(e, Exception) and (
        isinstance(e, GraphgrowError) or type(e).__module__.split(".")[0] == "graphgrow"
    )


@contextlib.contextmanager
def calling(what: str, hint: str | None = None, error: type[GraphgrowError] = InputError) -> Iterator[None]:
    """Run the block as the user's code `what` ("the data function mytask:batch"): prints to stderr, anything
    raised (BaseException included) as `error(f"{what} failed: …", hint)`; see the module docstring."""
    seen = _sigints[0]
    try:
        with contextlib.redirect_stdout(sys.stderr), _counting_sigint():
            yield
    except BaseException as e:
        if _graphgrows_own(e):
            raise
        if isinstance(e, KeyboardInterrupt) and _sigints[0] != seen:
            raise  # a real Ctrl-C: the command stops (exit 130), as anywhere else
        raise error(_what_happened(what, e), hint) from e


def _what_happened(what: str, e: BaseException) -> str:
    if isinstance(e, SystemExit):  # not an exit of graphgrow's: the command reports it like any failure
        return f"{what} failed: SystemExit (it called sys.exit({repr(e.code)[:100]}))"
    text = " ".join(str(e).split())
    return f"{what} failed: {type(e).__name__}" + (f": {text[:300]}" if text else "")


def guarded(fn: Callable[..., Any], what: str, hint: str | None = None) -> Callable[..., Any]:
    """`fn` whose every call runs under `calling(what, hint)` (a loss function called once per step)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with calling(what, hint):
            return fn(*args, **kwargs)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call
