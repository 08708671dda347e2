"""The types of graphgrow's stored metadata (a file's mutation log and trace report, an ONNX file's log).

The metadata is read from files, so every field a reader uses is checked for its type here, once, as the
file is loaded: a string where a record belongs, a number where a list belongs or a log entry without its
pass is a one-line LoadError naming the field (exit 2), never an exception deep in a reader. Fields not
listed are kept as they are (a later graphgrow may add some) and read by nobody.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.errors import LoadError

_HINT = "the file is corrupted or hostile; re-create it"


def _int(v: Any) -> bool:
    return type(v) is int  # bool is an int subclass, and not a count


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _record(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) for k in v)


_KINDS: dict[Callable[[Any], bool], str] = {
    _int: "a whole number",
    _str: "text",
    _bool: "true or false",
    _strs: "a list of text",
    _str_map: "a record of text",
    _record: "a record",
}

# field → (type check, required): what the log's readers use (print_log, pipeline.from_log, lineage, stages)
LOG_FIELDS: dict[str, tuple[Callable[[Any], bool], bool]] = {
    "pass": (_str, True),
    "args": (_record, True),
    "seed": (_int, False),
    "targets": (_record, False),
    "params_before": (_int, True),
    "params_after": (_int, True),
    "flops_before": (_int, False),
    "flops_after": (_int, False),
    "nodes_added": (_int, False),
    "nodes_removed": (_int, False),
    "exact": (_bool, False),
    "modules_added": (_strs, False),
}

# what capture.trace and capture.export_capture write, and show.print_trace / fidelity read
TRACE_FIELDS: dict[str, Callable[[Any], bool]] = {
    "mode": _str,
    "capture": _str,
    "auto_leaves": _str_map,
    "user_leaves": _strs,
    "mode_reads": _strs,
    "top_level_mode_dependent": _bool,
    "merged_blocks": _strs,
    "live_attributes": _strs,
    "frozen_attributes": _strs,
    "notes": _strs,
    "fidelity": _strs,
    "mode_switches": _int,
    "standins": _str_map,
    "layers_as_functions": _strs,
    "aten_ops": _strs,
}


def _refuse(where: str, field: str, check: Callable[[Any], bool], value: Any) -> LoadError:
    return LoadError(f"{where} has {field!r} as {type(value).__name__}, not {_KINDS[check]}", _HINT)


def check_log(log: list[Any], where: str = "the mutation log") -> None:
    """Each entry of a stored mutation log has the fields its readers use, of their types (LoadError otherwise)."""
    for i, entry in enumerate(log, 1):
        at = f"{where}'s entry {i}"
        for field, (check, required) in LOG_FIELDS.items():
            if field not in entry:
                if required:
                    raise LoadError(f"{at} has no {field!r}", _HINT)
                continue
            if not check(entry[field]):
                raise _refuse(at, field, check, entry[field])


def check_trace(trace: Any, where: str = "the trace report") -> None:
    """A stored trace report is a record whose known fields have their types (LoadError otherwise)."""
    if trace is None:
        return
    if not _record(trace):
        raise LoadError(f"{where} is {type(trace).__name__}, not a record", _HINT)
    for field, check in TRACE_FIELDS.items():
        if field in trace and not check(trace[field]):
            raise _refuse(where, field, check, trace[field])
