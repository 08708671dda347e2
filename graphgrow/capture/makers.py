"""While tracing, calls that make a tensor from sizes, and `Variable`, become the device-agnostic graph calls they
amount to.

Research code draws drop-path masks in many spellings. torch.empty/zeros/ones/full/rand/randn with a
traced size are recorded by watch.RecordConstructors; the spellings here fail under torch.fx as written:

- legacy typed constructors, `torch.cuda.FloatTensor(x.size(0), 1, 1, 1)` (published DARTS),
  `torch.FloatTensor(...)`, any dense `torch[.cuda].<Type>Tensor`, also through an alias bound in the
  model's code (`Tensor = torch.cuda.FloatTensor if use_cuda else torch.FloatTensor`): fx fails with
  "new() received an invalid combination of arguments - got (Proxy, ...)". Such a call makes an
  uninitialised tensor of the class's dtype; it becomes `torch.empty(sizes, dtype=<that dtype>,
  device=t.device)`, t the tensor its sizes were read from — the device is the input's, so a mask
  written for CUDA runs wherever the graph runs (a model traced on CPU runs on CUDA and the reverse).
- `x.new(*sizes)` (an uninitialised tensor like x): recorded as `x.new_empty(sizes)`, which the stored-graph
  policy knows; `x.new(data)` is left alone.
- `torch.autograd.Variable(t)`: `t.detach()` (what it returns today: the same data, no history).

A call this cannot read (sizes not read from a tensor, data instead of sizes) raises LegacyCallError naming
the call and the line of the model's code, which the trace report then gives as the block's reason.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch
from torch import fx, nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

_EMPTY = torch.empty  # the real one: watch.RecordConstructors swaps torch.empty while a trace runs
_NOT_THE_MODELS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__), "<")


class LegacyCallError(Exception):
    """A tensor-making call the tracer cannot express as a graph call; the message names the call and the line."""


def typed_classes() -> dict[str, Any]:
    """'torch.FloatTensor' → class, for every dense legacy typed tensor class (CPU and CUDA)."""
    return {
        f"{c.__module__}.{c.__name__}": c
        for c in torch._tensor_classes  # type: ignore[attr-defined]
        if c.__module__ in ("torch", "torch.cuda")
    }


def reads_size(n: Any) -> bool:
    """`n` is an integer computed from a tensor's sizes (x.size(0), x.shape[0], arithmetic on them)."""
    if type(n) is int:
        return True
    if not isinstance(n, fx.Node):
        return False
    if n.op == "call_method" and n.target in ("size", "dim", "numel"):
        return True
    if n.op == "call_function" and n.target is getattr:
        return len(n.args) == 2 and n.args[1] in ("shape", "ndim")
    if n.op == "call_function" and (
        n.target is len or getattr(n.target, "__module__", "") in ("_operator", "operator")
    ):
        return all(reads_size(a) for a in n.all_input_nodes) and bool(n.all_input_nodes)
    return False


def size_source(values: Any) -> fx.Node | None:
    """The first tensor whose sizes `values` (nodes, ints, tuples of them) were read from."""
    todo = [v for v in (values if isinstance(values, (list, tuple)) else [values]) if isinstance(v, fx.Node)]
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        if (n.op == "call_method" and n.target in ("size", "dim", "numel")) or (
            n.op == "call_function" and n.target is getattr and n.args[1:] in (("shape",), ("ndim",))
        ):
            src = n.args[0]
            return src if isinstance(src, fx.Node) else None
        todo.extend(n.all_input_nodes)
    return None


def user_frame() -> tuple[str, int] | None:
    """(file, line) of the innermost frame of the model's code (not torch's, not graphgrow's) running now."""
    frame = sys._getframe(1)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_NOT_THE_MODELS):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return None


def describe(where: tuple[str, int] | None) -> str:
    """'file.py:LINE: the code there' for a user_frame()."""
    import linecache

    if where is None:
        return "an unknown line"
    code = linecache.getline(*where).strip()
    return f"{os.path.basename(where[0])}:{where[1]}" + (f": {code}" if code else "")


def user_line() -> str:
    return describe(user_frame())


def _sizes(args: tuple) -> tuple | None:
    """The sizes a legacy constructor's positional arguments give, or None when they are data, not sizes."""
    if len(args) == 1 and isinstance(args[0], fx.Proxy):
        node = args[0].node  # x.size() / x.shape: a whole size
        whole = (node.op == "call_method" and node.target == "size" and len(node.args) == 1) or (
            node.op == "call_function" and node.target is getattr and node.args[1:] == ("shape",)
        )
        return (args[0],) if whole else None
    if len(args) == 1 and isinstance(args[0], torch.Size):
        return tuple(args[0])
    if args and all(type(a) is int or (isinstance(a, fx.Proxy) and reads_size(a.node)) for a in args):
        return args
    return None


class _TypedMaker:
    """Stands in for a typed class while a trace runs: called with traced sizes, records torch.empty; otherwise
    the class itself (calls, isinstance checks and attributes such as `dtype` behave as before)."""

    def __init__(self, tracer: fx.Tracer, label: str, cls: Any):
        self.tracer, self.label, self.cls = tracer, label, cls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(a, fx.Proxy) for a in tree_flatten((args, kwargs))[0]):
            return self.cls(*args, **kwargs)
        sizes = None if kwargs else _sizes(args)
        source = size_source([a.node if isinstance(a, fx.Proxy) else a for a in sizes]) if sizes else None
        if sizes is None or source is None:
            raise LegacyCallError(
                f"{self.label}(...) at {user_line()}: only sizes read from a tensor (x.size(0), "
                "x.shape) can be traced; write torch.empty(..., device=x.device) there"
            )
        device = self.tracer.create_proxy("call_function", getattr, (self.tracer.proxy(source), "device"), {})
        return self.tracer.create_proxy(
            "call_function", _EMPTY, tuple(sizes), {"dtype": self.cls.dtype, "device": device}
        )

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self.cls)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cls, name)


class RecordLegacyMakers:
    """Context manager: legacy typed constructors (by name in torch and torch.cuda, and names bound to them in
    the model's modules), `Variable` and `x.new` become graph calls (see the module docstring) while a trace runs."""

    def __init__(self, tracer: fx.Tracer, model: nn.Module):
        self.tracer, self.model = tracer, model
        self.undo: list[tuple[Any, str, Any]] = []  # (namespace dict or module, name, old value)
        self.had_new = False

    def _typed(self, label: str, cls: Any) -> _TypedMaker:
        return _TypedMaker(self.tracer, label, cls)

    def _set(self, where: Any, name: str, value: Any) -> None:
        space = where if isinstance(where, dict) else vars(where)
        self.undo.append((where, name, space[name]))
        if isinstance(where, dict):
            where[name] = value
        else:
            setattr(where, name, value)

    def _model_namespaces(self) -> list[dict]:
        """The globals of the modules that define the model's classes, and of the functions those name (a
        `drop_path` imported from a utils module draws its mask with that module's names)."""
        spaces: dict[int, dict] = {}
        for m in self.model.modules():
            mod = sys.modules.get(type(m).__module__)
            if mod is None or mod.__name__.split(".")[0] in ("torch", "graphgrow"):
                continue
            spaces[id(vars(mod))] = vars(mod)
        for space in list(spaces.values()):
            for v in list(space.values()):
                if isinstance(v, types.FunctionType) and v.__module__.split(".")[0] not in ("torch", "graphgrow"):
                    spaces.setdefault(id(v.__globals__), v.__globals__)
        return list(spaces.values())

    def __enter__(self):
        classes = typed_classes()
        by_id = {id(c): label for label, c in classes.items()}
        for label, cls in classes.items():
            module, _, name = label.rpartition(".")
            self._set(sys.modules[module], name, self._typed(label, cls))
        for space in self._model_namespaces():
            for name, v in list(space.items()):
                if id(v) in by_id and not name.startswith("__"):
                    self._set(space, name, self._typed(by_id[id(v)], v))
        # Variable is a Python class: its constructor is swapped in place, so every spelling that reaches it works
        self.had_new = "__new__" in vars(Variable)
        self.old_new = vars(Variable).get("__new__")
        base_new = torch._C._LegacyVariableBase.__new__

        def new(cls: type, *args: Any, **kwargs: Any) -> Any:
            if args and isinstance(args[0], fx.Proxy):
                return args[0].detach()
            return base_new(cls, *args, **kwargs)

        Variable.__new__ = staticmethod(new)  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc):
        if self.had_new:
            Variable.__new__ = self.old_new  # type: ignore[method-assign]
        else:
            del Variable.__new__
        for where, name, old in reversed(self.undo):
            if isinstance(where, dict):
                where[name] = old
            else:
                setattr(where, name, old)
        self.undo.clear()
        return False


def rewrite_new(kind: str, target: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple]:
    """`x.new(*sizes)` → `x.new_empty(sizes)` (the same uninitialised tensor, in a form the stored-graph policy
    knows); other calls unchanged. Returns (target, args)."""
    if kind != "call_method" or target != "new" or kwargs or len(args) < 2:
        return target, args
    sizes = args[1:]
    if (
        len(sizes) == 1
        and isinstance(sizes[0], fx.Node)
        and size_source(sizes[0]) is sizes[0].args[0]
        and sizes[0].op == "call_method"
        and len(sizes[0].args) == 1
    ):
        return "new_empty", (args[0], sizes[0])  # x.new(y.size())
    if all(type(s) is int or (isinstance(s, fx.Node) and reads_size(s)) for s in sizes):
        return "new_empty", (args[0], tuple(sizes))
    return target, args
