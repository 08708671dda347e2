"""Pipelines: specs like `grow_width(target=layer1.0.conv1,factor=2),add_residual`, run with verification."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import fx

from ..analysis.budget import Limits
from ..core.errors import GraphgrowError, InputError, SpecError, with_context
from ..core.threads import check_threads
from ..graph.graph_meta import input_spec_of
from ..rewrite.pass_base import Pass, PassResult, require_traced
from .registry import get_pass


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside parentheses, brackets and quotes."""
    return [part for part, _ in _split_with_offsets(text, sep)]


def _split_with_offsets(text: str, sep: str = ",", base: int = 0, spec: str | None = None) -> list[tuple[str, int]]:
    """(part, offset of its first non-blank character in `spec`) for each part between top-level `sep`s."""
    spec = text if spec is None else spec
    parts: list[tuple[str, int]] = []
    start = 0
    opened: list[int] = []
    quote, quote_at = None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote, quote_at = ch, i
        elif ch in "([":
            opened.append(i)
        elif ch in ")]":
            if not opened:
                raise SpecError(
                    "unbalanced ')' in the pipeline spec", "remove it or open a '(' before it", spec, base + i
                )
            opened.pop()
        elif ch == sep and not opened:
            parts.append(_part(text, start, i, base))
            start = i + 1
    if quote:
        raise SpecError("unclosed quote in the pipeline spec", "close it", spec, base + quote_at)
    if opened:
        raise SpecError("unclosed parenthesis in the pipeline spec", "close it with ')'", spec, base + opened[-1])
    parts.append(_part(text, start, len(text), base))
    return parts


def _part(text: str, start: int, end: int, base: int) -> tuple[str, int]:
    raw = text[start:end]
    return raw.strip(), base + start + (len(raw) - len(raw.lstrip()))


@dataclass
class _Step:
    name: str
    args: dict[str, str]
    at: int  # offset of the pass name in the spec
    arg_at: dict[str, int]  # offset of each argument


def _parse(text: str) -> list[_Step]:
    steps = []
    for item, at in _split_with_offsets(text):
        if not item:
            raise SpecError("empty pass in the pipeline spec", "separate passes with single commas", text, at)
        name, paren, rest = item.partition("(")
        name = name.strip()
        if not name.isidentifier():
            raise SpecError(f"bad pass name {name[:60]!r} in the pipeline spec", "write name(arg=value,...)", text, at)
        step = _Step(name, {}, at, {})
        if paren:
            if not rest.endswith(")"):
                raise SpecError(f"missing ')' after the arguments of {name}", None, text, at + len(item))
            body_at = at + item.index("(") + 1
            body = rest[:-1]
            for kv, kv_at in _split_with_offsets(body, ",", body_at, text) if body.strip() else []:
                key, eq, value = kv.partition("=")
                if not eq or not key.strip().isidentifier():
                    raise SpecError(f"argument {kv[:60]!r} of {name} is not key=value", None, text, kv_at)
                if key.strip() in step.args:
                    raise SpecError(f"argument {key.strip()!r} given twice to {name}", None, text, kv_at)
                step.args[key.strip()] = value.strip()
                step.arg_at[key.strip()] = kv_at
        steps.append(step)
    return steps


def parse_spec(text: str) -> list[tuple[str, dict[str, str]]]:
    """`a(x=1,y=b),c` → [("a", {"x": "1", "y": "b"}), ("c", {})]. Values stay strings."""
    return [(step.name, step.args) for step in _parse(text)]


def _strip_quotes(v: str) -> str:
    return v[1:-1] if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"" else v


def coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert a spec string (or a Python value) to the field's declared type."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if type(None) in options and (
            value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))
        ):
            return None
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return coerce(value, opt, where)
            except SpecError as e:
                errors.append(e.message)
        raise SpecError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is Literal:
        choices = typing.get_args(annotation)
        v = _strip_quotes(value) if isinstance(value, str) else value
        if v not in choices:
            raise SpecError(f"{where} must be one of {', '.join(map(str, choices))}, got {value!r}")
        return v
    if not isinstance(value, str):
        if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise SpecError(f"{where} must be a finite number, got {value!r}")
            return float(value)
        if isinstance(value, annotation) and not (annotation is int and isinstance(value, bool)):
            return value
        raise SpecError(f"{where} must be {annotation.__name__}, got {type(value).__name__} {value!r}")
    v = _strip_quotes(value)
    try:
        if annotation is bool:
            if v.lower() in ("true", "1", "yes"):
                return True
            if v.lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if annotation is int:
            return int(v)
        if annotation is float:
            number = float(v)
            if not math.isfinite(number):
                raise SpecError(f"{where} must be a finite number, got {value[:40]!r}")
            return number
        if annotation is str:
            return v
    except ValueError:
        pass
    else:
        raise SpecError(f"{where}: unsupported argument type {annotation}")
    raise SpecError(f"{where} must be {annotation.__name__}, got {value!r}")


def make_pass(name: str, args: dict[str, Any]) -> Pass:
    """Instantiate a registered pass from spec arguments, with typed errors."""
    cls = get_pass(name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = cls.argument_types()
    unknown = [k for k in args if k not in fields]
    if unknown:
        valid = ", ".join(fields) or "none"
        raise SpecError(
            f"pass {name} has no argument {', '.join(map(repr, unknown))}",
            f"valid arguments: {valid}",
            argument=unknown[0],
        )
    kwargs = {}
    for k, v in args.items():
        try:
            kwargs[k] = coerce(v, hints[k], f"{name}({k}=...)")
        except SpecError as e:
            raise SpecError(
                e.message, e.hint or f"`graphgrow passes` lists {name}'s arguments, types and defaults", argument=k
            ) from None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise SpecError(f"bad arguments for {name}: {e}") from e


def build_pipeline(specs: str | Sequence[str]) -> list[Pass]:
    """One or more spec strings → pass instances, in order."""
    if isinstance(specs, str):
        specs = [specs]
    passes: list = []
    for spec in specs:
        for step in _parse(spec):
            try:
                passes.append(make_pass(step.name, step.args))
            except SpecError as e:  # point at the argument, else at the pass
                raise SpecError(
                    e.message, e.hint, spec, step.arg_at.get(e.argument or "", step.at), e.argument
                ) from None
    if not passes:
        raise SpecError("no pass given", "e.g. --pass add_residual")
    return passes


def spec_of(p: Pass) -> str:
    """The spec string that rebuilds `p` (non-default arguments only)."""
    args = [f"{f.name}={getattr(p, f.name)}" for f in dataclasses.fields(p) if getattr(p, f.name) != f.default]
    return f"{p.name}({','.join(args)})" if args else p.name


def from_log(log: list[dict], verify: bool = True, *, data: Any = None, trust: bool = False) -> Pipeline:
    """The pipeline that a mutation log records, with each pass's own seed: replaying it on the
    original model gives a bit-identical result.

    A log is read from a file, so a name in it is data: an argument that names code (gradmax's `data`,
    `package.module:function`; Pass.code_arguments) is never imported from the log. A step that logged one
    runs with the user's own `data` (a name or a function: the user names it again), or with the logged
    name only when the user trusts the file (`trust`); otherwise the step is refused (InputError)."""
    if not log:
        raise SpecError("the mutation log is empty: nothing to replay", "replay a model that graphgrow grew")
    try:
        steps = [(e["pass"], dict(e.get("args", {}))) for e in log]
        seeds = [int(e["seed"]) for e in log]
        if any(not 0 <= s < 2**63 for s in seeds):
            raise ValueError("a seed is outside 0 … 2**63 − 1")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SpecError(f"the mutation log is malformed: {e}", "it should come from a graphgrow output file") from e
    given = {"data": data} if data is not None else {}
    again: dict[int, dict[str, Any]] = {}  # step → the user's values: set on the pass as given (a function too)
    for i, key, value in logged_code(log):
        if key in given:
            again.setdefault(i - 1, {})[key] = given[key]
            del steps[i - 1][1][key]
        elif not trust:
            raise InputError(
                f"step {i} of the mutation log ({steps[i - 1][0]}) was grown with {key}={value[:200]}, a "
                "function the file names: graphgrow never imports a name read from a file",
                f"name it again to replay the step: --{key} {value[:200]} ({key}=... in Python), "
                "or pass --trust if you trust the file",
            )
    passes = [make_pass(name, args) for name, args in steps]
    passes = [dataclasses.replace(p, **again[i]) if i in again else p for i, p in enumerate(passes)]
    return Pipeline(passes, verify=verify, seeds=seeds)


def logged_code(log: list[dict]) -> list[tuple[int, str, str]]:
    """(step from 1, argument, the logged name) for every argument of the log that names code (Pass.code_arguments)
    with a value: what replaying the log needs the user to name again."""
    found = []
    for i, entry in enumerate(log, 1):
        args = entry.get("args") if isinstance(entry, dict) else None
        if not isinstance(args, dict) or not isinstance(entry.get("pass"), str):
            continue  # from_log says what is malformed
        for key in get_pass(entry["pass"]).code_arguments():
            if args.get(key) is not None:
                shown = "".join(c if c.isprintable() else "?" for c in str(args[key])[:200])  # echoed: no escapes
                found.append((i, key, shown))
    return found


def _example_shape(gm: fx.GraphModule) -> Any:
    """The model's stored example input, or None (the pass itself says what is missing)."""
    try:
        return input_spec_of(gm)
    except GraphgrowError:
        return None


@dataclass
class PipelineResult:
    gm: fx.GraphModule
    results: list[PassResult] = field(default_factory=list)

    @property
    def log(self) -> list[dict]:
        return list(self.gm.meta["graphgrow"]["log"])


@dataclass
class Pipeline:
    """Passes run in order on copies, each verified before the next one starts."""

    passes: list[Pass]
    verify: bool = True
    seed: int = 0
    seeds: list[int] | None = None  # one per pass (replay); default: seed, seed + 1, ...
    limits: Limits | None = None  # what one pass may add (budget.Limits); None: the defaults
    share: bool = False  # True: the result shares untouched parameters with the input too (Pass.__call__'s share)

    @classmethod
    def from_spec(cls, specs: str | Sequence[str], verify: bool = True, seed: int = 0, share: bool = False) -> Pipeline:
        return cls(build_pipeline(specs), verify=verify, seed=seed, share=share)

    def run(self, gm: fx.GraphModule, progress: Callable[[int, Pass], None] | None = None) -> PipelineResult:
        require_traced(gm)
        results = []
        current = gm
        for i, p in enumerate(self.passes):
            if progress:
                progress(i, p)
            seed = self.seeds[i] if self.seeds is not None else self.seed + i
            try:
                with check_threads(current, _example_shape(current)):  # a small model: one thread (core.threads)
                    # a model the pipeline made itself shares what the next pass leaves alone; the caller's model only
                    # when asked (training the result would move its weights too)
                    r = p(current, verify_result=self.verify, seed=seed, limits=self.limits, share=self.share or i > 0)
            except GraphgrowError as e:
                if len(self.passes) == 1:
                    raise
                raise with_context(e, f"step {i + 1}/{len(self.passes)} {spec_of(p)}") from e
            results.append(r)
            current = r.gm
        return PipelineResult(current, results)
