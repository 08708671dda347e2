"""While tracing, reads of a module's `training` flag and of its plain number attributes ask the tracer.

torch.fx runs forward() once with proxies for tensors, so a module attribute read in forward
(`self.training`, `self.drop_path_prob`) is a Python value at trace time and would be frozen
into the graph. Each module's class is swapped, for the duration of a trace, for a subclass
whose properties hand those reads to the tracer, which answers with a graph node (a value read
at run time) or with the plain value (and remembers that it froze it). Classes are put back on exit.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

SCALAR_TYPES = (bool, int, float)


class Reader(Protocol):
    def read_training(self, owner: nn.Module, value: bool) -> Any: ...
    def read_scalar(self, owner: nn.Module, name: str, value: Any) -> Any: ...


def scalar_attributes(m: nn.Module) -> tuple[str, ...]:
    """Plain bool/int/float attributes a forward may read (not `training`, which is watched on its own)."""
    return tuple(sorted(k for k, v in vars(m).items() if type(v) in SCALAR_TYPES and k != "training"))


def settings(m: nn.Module) -> tuple:
    """A module's class and the settings that choose its code path: flags, strings and which attributes are None
    (sizes and rates only count by their type: blocks of one class at different widths take the same branches)."""

    def kind(v: Any) -> Any:
        return type(v) if type(v) in (int, float) else v

    plain = (bool, int, float, str, type(None))
    return type(m), tuple(
        sorted((k, kind(v)) for k, v in vars(m).items() if type(v) in plain and not k.startswith("_"))
    )


def _watched(base: type, scalars: tuple[str, ...], box: list) -> type:
    def flag_get(self):
        value = self.__dict__.get("training", True)
        return box[0].read_training(self, value) if box else value

    def flag_put(self, value):
        self.__dict__["training"] = value

    def scalar_property(name: str) -> property:
        def get(self):
            value = self.__dict__[name]
            return box[0].read_scalar(self, name, value) if box else value

        def put(self, value):
            self.__dict__[name] = value

        return property(get, put)

    members: dict[str, Any] = {
        "training": property(flag_get, flag_put),
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "_gg_watched": True,
    }
    for name in scalars:
        if not isinstance(getattr(base, name, None), property):  # a class property is the class's own business
            members[name] = scalar_property(name)
    return type(base.__name__, (base,), members)


class WatchModules:
    """Context manager: every module of `model` reports flag and number reads to `reader`."""

    def __init__(self, model: nn.Module, reader: Reader):
        self.model, self.reader = model, reader
        self.swapped: list[tuple[nn.Module, type]] = []
        self.box: list = []

    def __enter__(self):
        self.box.append(self.reader)
        for m in self.model.modules():
            cls = type(m)
            try:
                m.__class__ = _watched(cls, scalar_attributes(m), self.box)
            except TypeError:  # scripted or slotted classes cannot be swapped; fx cannot trace them anyway
                continue
            self.swapped.append((m, cls))
        return self

    def __exit__(self, *exc):
        self.box.clear()
        for m, cls in reversed(self.swapped):
            m.__class__ = cls
        return False


# Tensor constructors that fx cannot trace when a size is a proxy (`torch.empty(x.size(0), 1, 1, 1)`,
# as drop-path masks are built): recorded as graph calls instead while a trace runs.
CONSTRUCTORS = ("empty", "zeros", "ones", "full", "rand", "randn")


class RecordConstructors:
    """Context manager: torch.empty/zeros/ones/full/rand/randn called with a proxy anywhere in their
    arguments become call_function nodes of `tracer`; with plain arguments they run as usual."""

    def __init__(self, tracer: fx.Tracer):
        self.tracer = tracer
        self.saved: dict[str, Any] = {}

    def _wrap(self, original: Any) -> Any:
        tracer = self.tracer

        def constructor(*args: Any, **kwargs: Any) -> Any:
            flat, _ = tree_flatten((args, kwargs))
            if any(isinstance(a, fx.Proxy) for a in flat):
                return tracer.create_proxy("call_function", original, args, kwargs)
            return original(*args, **kwargs)

        return constructor

    def __enter__(self):
        for name in CONSTRUCTORS:
            self.saved[name] = getattr(torch, name)
            setattr(torch, name, self._wrap(self.saved[name]))
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch, name, original)
        return False
