"""torch.export and values read from tensors: what capture does about them, and what it says when it cannot.

torch.export captures one graph for every input of the example's shapes. A number read from a tensor's values
(`.item()`, `nonzero`, a boolean mask's count, a size passed through a tensor such as `torch.div` on sizes) is a
symbol torch cannot see into (u0, u1, ...); a size or a branch that needs it fails with "Could not guard on
data-dependent expression". Two things follow:

- `exporting()`: torch.distributions' argument validation is off while exporting. It checks each distribution's
  arguments by their values (`logits` not NaN) and raises where they fail: a branch on the data that computes
  nothing (Hugging Face BLT's patcher: `Categorical(logits=...).entropy()`). The captured graph computes the same
  outputs; invalid arguments give NaN in it where the model would raise.
- `export_refusal`: where the failure is such a guard, the refusal says so in graphgrow's words, naming the
  model's line that needs the value, the operation that read it from a tensor and where, and why one graph cannot
  hold it, instead of torch's raw first line. Read from torch's message (its partial graph names each symbol's
  defining node with its source line; "The following call raised this error" names the model's line).
"""

from __future__ import annotations

import contextlib
import re
import traceback
from collections.abc import Iterator

from torch import distributions, nn

from ..core.errors import TraceError, first_line

_GUARD = re.compile(r"data-dependent expression (.+?) \(unhinted")
_CALL = re.compile(r'The following call raised this error:\n\s*File "([^"]+)", line (\d+), in (\w+)\n\s*(.*)')
_SOURCE = re.compile(r"# File: (\S+?):(\d+) in (\w+), code: (.*)")
_HINT = "check that the model runs on the example inputs; caches off (use_cache=False)"


@contextlib.contextmanager
def exporting() -> Iterator[None]:
    """While torch.export runs: torch.distributions' value checks off (they branch on the data, computing nothing)."""
    was = distributions.Distribution._validate_args
    distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        distributions.Distribution.set_default_validate_args(was)


def _where(path: str, line: str) -> str:
    return f"{path.rpartition('site-packages/')[2] or path}:{line}"


def _reader(message: str, symbol: str) -> str | None:
    """The node of torch's partial graph that first holds `symbol` (a number read from a tensor), as 'OP of
    ARG (FILE:LINE: CODE)'."""
    source = None
    for line in message.splitlines():
        if m := _SOURCE.search(line):
            source = m
            continue
        m = re.match(r'\s*(\w+): "([^"]*)" = torch\.ops\.(\w+)\.([\w.]+)\(([^,);]*)', line)
        if m and re.search(rf"\b{symbol}\b", m.group(2)):
            op = f"{m.group(4).partition('.')[0]} of '{m.group(5)}'" if m.group(5) else m.group(4)
            where = f" at {_where(source.group(1), source.group(2))}: `{source.group(4).strip()}`" if source else ""
            return f"'{m.group(1)}' ({op}){where}"
    return None


def _asker(e: BaseException) -> str:
    """The model's line that asked, where torch's message does not say it (a Python `if` on the value): the innermost
    frame of the traceback outside torch and graphgrow."""
    frames = [
        f for f in traceback.extract_tb(e.__traceback__) if not re.search(r"[/\\](torch|graphgrow)[/\\]", f.filename)
    ]
    if not frames:
        return "it"
    f = frames[-1]
    return f"{_where(f.filename, str(f.lineno))} ({f.name}: `{(f.line or '').strip()}`)"


def data_dependent_why(e: BaseException) -> str | None:
    """graphgrow's words for torch.export's guard on a data-dependent value, or None where `e` is no such guard."""
    message = str(e)
    guard = _GUARD.search(message)
    if guard is None:
        return None
    cond = guard.group(1)
    call = _CALL.search(message)
    asks = f"{_where(call.group(1), call.group(2))} ({call.group(3)}: `{call.group(4).strip()}`)" if call else _asker(e)
    readers = [r for s in dict.fromkeys(re.findall(r"\bu\d+\b", cond)) if (r := _reader(message, s)) is not None]
    read = f"; the number is read from a tensor's values by {', '.join(readers)}" if readers else ""
    return (
        f"{asks} needs to decide {cond} on a number read from tensor values{read}. torch.export captures one graph "
        "for every input of these shapes, so a size or a branch that follows the values (.item(), nonzero, a "
        "mask's count, a size passed through a tensor) cannot be captured"
    )


def export_refusal(model: nn.Module, e: BaseException, train: bool) -> TraceError:
    mode = "train" if train else "eval"
    why = data_dependent_why(e)
    hint = (
        "where the value is the same for every input, say so in the model's code (torch._check(...)), or compute "
        "the size from tensor sizes rather than through a tensor"
        if why
        else _HINT
    )
    return TraceError(
        f"torch.export cannot capture {type(model).__name__} in {mode} mode: {why or first_line(e)}", hint
    )
