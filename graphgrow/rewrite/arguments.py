"""Pass arguments declared once. `arg()` declares a dataclass field of a pass: its default, one line of help, and
the values it allows (choices, a range, a check); a `Literal[...]` annotation gives its choices. The values are
checked when the pass is constructed (Pass.__post_init__, so when a spec is parsed, before any model is loaded):
a SpecError naming the pass, the argument, the value and what is allowed.

The pass's plain function (`@pass_function`) takes no defaults of its own: a call that leaves an argument out gets
the declared default, and its values are checked by the same declaration.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.errors import SpecError


@dataclass(frozen=True)
class Allowed:
    """The values one argument allows. `low`/`high` are inclusive bounds, `above`/`below` exclusive ones;
    `check(value)` returns why a value is refused (a phrase: "must be ..."), or None. None always passes where the
    annotation admits it (an argument left at None means "not given")."""

    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    above: float | None = None
    below: float | None = None
    check: Callable[[Any], str | None] | None = None

    def describe(self) -> str:
        """What is allowed, in words ("one of a|b", "in [1, 16]", "≥ 1", and the first line of `check`'s docstring);
        "" when any value of the type is."""
        said = (self.check.__doc__ or "").strip().splitlines()[:1] if self.check is not None else []
        return ", ".join([part for part in [self._values()] if part] + said)

    def _values(self) -> str:
        if self.choices is not None:
            return "one of " + "|".join(map(str, self.choices))
        lower = (
            f"[{_num(self.low)}" if self.low is not None else f"({_num(self.above)}" if self.above is not None else None
        )
        upper = (
            f"{_num(self.high)}]"
            if self.high is not None
            else f"{_num(self.below)})"
            if self.below is not None
            else None
        )
        if lower and upper:
            return f"in {lower}, {upper}"
        if lower:
            return ("≥ " if lower[0] == "[" else "> ") + lower[1:]
        if upper:
            return ("≤ " if upper[-1] == "]" else "< ") + upper[:-1]
        return ""

    def problem(self, value: Any) -> str | None:
        """Why `value` is refused (completing "<pass>(<arg>=...) ..."), or None when it is allowed."""
        if self.choices is not None and value not in self.choices:
            return f"must be one of {', '.join(map(str, self.choices))}"
        bounded = any(b is not None for b in (self.low, self.high, self.above, self.below))
        if bounded:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"must be a number {self._values()}"
            if math.isnan(value) or not (
                (self.low is None or value >= self.low)
                and (self.high is None or value <= self.high)
                and (self.above is None or value > self.above)
                and (self.below is None or value < self.below)
            ):
                return f"must be {self._values()}"
        return self.check(value) if self.check is not None else None


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


def arg(
    default: Any,
    help: str,
    *,
    choices: typing.Iterable[Any] | None = None,
    low: float | None = None,
    high: float | None = None,
    above: float | None = None,
    below: float | None = None,
    check: Callable[[Any], str | None] | None = None,
    names_code: bool = False,
) -> Any:
    """A pass argument, declared once: its default, one line of help (shown by `graphgrow passes` and
    docs/passes.md's table) and the values it allows: `choices`, a range (`low`/`high` inclusive, `above`/`below`
    exclusive) or a `check(value) -> why refused | None` for anything else. A `Literal[...]` annotation gives the
    choices by itself. The type comes from the field's annotation.
    `names_code`: its value names code the pass imports and calls (gradmax's `data`, `package.module:function`):
    a value read back from a mutation log is then never used unless the user names it again or trusts the file
    (pipeline.from_log)."""
    allowed = Allowed(tuple(choices) if choices is not None else None, low, high, above, below, check)
    return dataclasses.field(default=default, metadata={"help": help, "names_code": names_code, "allowed": allowed})


def literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    """The values of a Literal annotation (also inside `Literal[...] | None`), or None for any other type."""
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [c for a in typing.get_args(annotation) for c in (literal_choices(a) or ())]
        return tuple(found) or None
    return None


def admits_none(annotation: Any) -> bool:
    return annotation is type(None) or (
        typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation)
    )


def allowed_values(cls: type) -> dict[str, Allowed]:
    """Each argument's Allowed: its declaration, with the choices of a Literal annotation when none are declared."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        declared = f.metadata.get("allowed") or Allowed()
        if declared.choices is None and (choices := literal_choices(hints[f.name])) is not None:
            declared = dataclasses.replace(declared, choices=choices)
        out[f.name] = declared
    return out


def check_arguments(p: Any) -> None:
    """SpecError for the first argument of pass `p` whose value its declaration does not allow."""
    cls = type(p)
    hints = typing.get_type_hints(cls)
    for name, allowed in allowed_values(cls).items():
        value = getattr(p, name)
        if value is None and admits_none(hints[name]):
            continue
        why = allowed.problem(value)
        if why is not None:
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:60] + "…"
            raise SpecError(
                f"{cls.name}({name}=...) {why}, got {shown}",
                f"`graphgrow passes` lists {cls.name}'s arguments and the values each allows",
                argument=name,
            )


class PassFunction:
    """A pass's plain function whose arguments are declared by the pass (the Pass subclass whose `function` it is):
    an argument left out of a call gets the declared default, and every value is checked by the declaration
    (SpecError) before the function runs. The function itself gives its pass arguments no defaults."""

    def __init__(self, function: Callable[..., Any]):
        functools.update_wrapper(self, function)
        self.raw = function
        self.declared_by: type | None = None

    def bind(self, cls: type) -> None:
        if self.declared_by is not None and self.declared_by is not cls:
            raise TypeError(f"{self.raw.__qualname__} is already the function of {self.declared_by.__qualname__}")
        self.declared_by = cls

    def _pass(self) -> type:
        if self.declared_by is None:
            raise TypeError(f"{self.raw.__qualname__} is a pass function but no Pass sets it as its `function`")
        return self.declared_by

    @property
    def __signature__(self) -> inspect.Signature:  # what help() and IDEs show: the declared defaults
        defaults = {f.name: f.default for f in dataclasses.fields(self._pass())}
        sig = inspect.signature(self.raw)
        return sig.replace(
            parameters=[
                p.replace(default=defaults[p.name]) if p.name in defaults else p for p in sig.parameters.values()
            ]
        )

    def __call__(self, gm: Any, *args: Any, **kwargs: Any) -> Any:
        cls = self._pass()
        sig = inspect.signature(self.raw)
        bound = sig.bind_partial(gm, *args, **kwargs).arguments
        names = {f.name for f in dataclasses.fields(cls)}
        p = cls(**{k: v for k, v in bound.items() if k in names})  # defaults filled, values checked
        p.check_requires(gm)
        first = next(iter(sig.parameters))  # the model
        rest = {k: v for k, v in bound.items() if k not in names and k != first}
        return self.raw(gm, **p.args(), **rest)

    def __repr__(self) -> str:
        return f"<pass function {self.raw.__module__}.{self.raw.__qualname__}>"

    def __reduce__(self) -> tuple[Any, ...]:  # pickled by reference, as the plain function it replaces was
        return _by_name, (self.raw.__module__, self.raw.__qualname__)


def _by_name(module: str, qualname: str) -> Any:
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def pass_function(function: Callable[..., Any]) -> PassFunction:
    """Decorate a pass's plain function: its pass arguments take no defaults in its signature; the Pass that sets it
    as `function` declares them (defaults, allowed values) once, for the spec parser, the docs and direct calls."""
    return PassFunction(function)
