"""Passes are found through the entry-point group "graphgrow.passes".

Built-in passes register there exactly as a third-party package would, so a plugin
is a first-class citizen. `register_pass` adds one in-process (tests, notebooks).
"""

from __future__ import annotations

from importlib.metadata import entry_points

from ..core.errors import SpecError
from ..rewrite.pass_base import Pass

GROUP = "graphgrow.passes"
_local: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Register a Pass subclass in this process (usable as a decorator)."""
    _check(cls, f"{cls.__module__}.{cls.__qualname__}")
    _local[cls.name] = cls
    return cls


def _check(cls, where: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Pass) and cls.name):
        raise SpecError(
            f"{where} is not a graphgrow Pass with a name", "subclass graphgrow.Pass and set name: ClassVar[str]"
        )


def _entry_points() -> dict:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def pass_names() -> list[str]:
    return sorted(set(_entry_points()) | set(_local))


def get_pass(name: str) -> type[Pass]:
    """The Pass class registered as `name`. SpecError lists the valid names otherwise."""
    if name in _local:
        return _local[name]
    eps = _entry_points()
    if name not in eps:
        raise SpecError(f"unknown pass '{name}'", f"valid passes: {', '.join(pass_names()) or 'none installed'}")
    try:
        cls = eps[name].load()
    except Exception as e:
        raise SpecError(
            f"pass '{name}' is registered by {eps[name].value} but fails to import: {e}",
            "reinstall or remove the package that provides it",
        ) from e
    _check(cls, eps[name].value)
    if cls.name != name:
        raise SpecError(
            f"entry point '{name}' loads a pass named '{cls.name}'", "the entry-point name must equal the pass's name"
        )
    return cls


def all_passes() -> dict[str, type[Pass] | SpecError]:
    """Every registered pass, or the error that stops it from loading."""
    out: dict[str, type[Pass] | SpecError] = {}
    for name in pass_names():
        try:
            out[name] = get_pass(name)
        except SpecError as e:
            out[name] = e
    return out
