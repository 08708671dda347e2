"""The symbolic tracer trace.py runs: leaves honoured, the module stack kept (for the errors and the report), and
reads of `training` and of live number attributes turned into graph values computed at run time.

Python branching on such a value raises _ModeBranch (the module becomes a leaf) or _Frozen (a live number used for
its value), except inside a block being mode-merged: there every branch is answered by a policy and recorded as a
mode_paths.Condition, so mode_merge can rebuild every path from traces taken with different answers.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from torch import fx, nn

from ..graph.fx_edit import computed_from, reads_flag
from . import mode_paths
from .attr_index import IndexedGetattr
from .makers import RecordLegacyMakers, rewrite_new, user_frame
from .watch import RecordConstructors, WatchModules


class _ModeBranch(BaseException):
    """Python control flow on a module's `training` flag.

    BaseException: user code's `except Exception` must not eat it."""


class _Frozen(BaseException):
    """A live number attribute used where Python needs its value (range(), int(), a branch outside a merged block)."""

    def __init__(self, attrs: set[tuple[type, str]]):
        super().__init__()
        self.attrs = attrs


class _CondProxy(fx.Proxy):
    """A traced read of `training` or of a live number attribute (or arithmetic on them): a value
    the graph computes at run time. Python may branch on it only inside a block being mode-merged."""

    def __bool__(self) -> bool:
        frame = sys._getframe(1)  # the code that branches: its `if` is the site's location
        return self.tracer.decide(self, (frame.f_code.co_filename, frame.f_lineno))  # type: ignore[attr-defined]

    def _needs_value(self, *_):
        raise _Frozen(self.tracer.live_sources(self.node))  # type: ignore[attr-defined]

    __index__ = __int__ = __float__ = __len__ = __iter__ = _needs_value  # type: ignore[assignment]


class _Tracer(IndexedGetattr):
    """Symbolic tracer that honours leaves, remembers where it is and traces `training` reads.

    `split` names modules whose forward branches on their mode: there every branch on a flag or a
    live number is answered by `policy(where its chain of conditions starts, answers so far)` and
    recorded, so mode_merge can rebuild every path from traces taken with different answers. With `live`,
    plain number attributes (not `_private`, not bool, not in `frozen`) are read at run time.
    """

    def __init__(
        self,
        leaves: set[str],
        root_constant: bool | None,
        mode_free: AbstractSet[str] = frozenset(),
        split: AbstractSet[str] = frozenset(),
        policy: Callable[[Any, tuple[bool, ...]], bool] | None = None,
        live: bool = False,
        frozen: AbstractSet[tuple[type, str]] = frozenset(),
    ):
        super().__init__()
        self.leaves = leaves
        self.root_constant = root_constant  # the top-level forward's `training`, when it branches on it
        self.mode_free = mode_free  # modules that branch on `training` but trace the same in both modes
        self.split, self.policy, self.live, self.frozen = split, policy, live, frozen
        self.stack: list[tuple[str, str]] = []  # (module path, class name), innermost last
        self.mode_reads: dict[str, str] = {}  # module path whose flag was read → path of the reader
        self.branch_at: tuple[str, str] | None = None  # where a `_ModeBranch` came from
        self.values: set[fx.Node] = set()  # nodes computed from flags and live numbers only
        self.live_nodes: dict[fx.Node, tuple[type, str]] = {}  # get_attr of a live number → (class, name)
        self.frozen_reads: set[str] = set()  # public number attributes read as constants
        self.live_paths: set[str] = set()  # number attributes read at run time
        self.conditions: list[mode_paths.Condition] = []
        self.answered: dict[Any, bool] = {}  # each value branched on (_value_key), with the answer it was given
        self.site, self.site_open = -1, False
        self.history: list[bool] = []  # the answers given so far in the chain of conditions being asked now
        self.site_location: Any = None
        self.last_data: fx.Node | None = None  # the last node that is not a flag/number value

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        self.stack.append((self.path_of_module(m), type(m).__name__))
        out = super().call_module(m, forward, args, kwargs)
        self.stack.pop()  # not reached on error: the failing module stays on top
        return out

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        target, args = rewrite_new(kind, target, args, kwargs)  # x.new(*sizes) → x.new_empty(sizes)
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if self.policy is not None:  # merging: a merge failure names the model's line that made the node
            node.meta["gg_source"] = user_frame()
        inputs = node.all_input_nodes
        if kind in ("call_function", "call_method") and inputs and all(a in self.values for a in inputs):
            self.values.add(node)
        else:
            self.last_data, self.site_open = node, False
        return node

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _CondProxy(node, self) if node in self.values else super().proxy(node)

    def _value_node(self, target: str) -> fx.Node:
        last, site_open = self.last_data, self.site_open
        node = self.create_node("get_attr", target, (), {})
        self.values.add(node)
        self.last_data, self.site_open = last, site_open  # reading a flag or number is not tensor work
        return node

    def read_training(self, owner: nn.Module, value: bool) -> Any:
        """What `owner.training` evaluates to while tracing."""
        reader = self.stack[-1][0] if self.stack else ""
        if not reader and self.root_constant is not None:
            return self.root_constant
        if reader in self.mode_free:
            return value  # either mode traces to the same graph: a constant is faithful
        try:
            path = self.path_of_module(owner)
        except NameError:  # not part of the model (a temporary module built in forward)
            return value
        self.mode_reads[path] = reader
        return self.proxy(self._value_node(f"{path}.training" if path else "training"))

    def read_scalar(self, owner: nn.Module, name: str, value: Any) -> Any:
        """What a plain number attribute evaluates to while tracing: a run-time read when live."""
        key = (type(owner).__mro__[1], name)
        try:
            path = self.path_of_module(owner)
        except NameError:
            return value
        if name.startswith("_"):
            return value
        if not self.live or type(value) is bool or key in self.frozen:
            self.frozen_reads.add(f"{path}.{name}" if path else name)
            return value
        node = self._value_node(f"{path}.{name}" if path else name)
        self.live_nodes[node] = key
        self.live_paths.add(str(node.target))
        return self.proxy(node)

    def live_sources(self, node: fx.Node) -> set[tuple[type, str]]:
        return {self.live_nodes[n] for n in computed_from(node) if n in self.live_nodes}

    def decide(self, proxy: fx.Proxy, location: Any = None) -> bool:
        """Python branches on a flag or live number: answered inside a block being merged, else refused."""
        reader = self.stack[-1][0] if self.stack else ""
        if reader not in self.split or self.policy is None:
            if self.live_sources(proxy.node) and not reads_flag(proxy.node):
                raise _Frozen(self.live_sources(proxy.node))
            raise _ModeBranch()
        if len(self.conditions) >= mode_paths.MAX_CONDITIONS:
            raise mode_paths.MergeError(
                reader,
                f"it asks more than {mode_paths.MAX_CONDITIONS} conditions in one "
                "trace (a loop on a flag or a live number?)",
            )
        # the same value asked again (`augment = self.training and x`, then `if augment:` in a callee; `if
        # self.training:` twice) has the answer it was given: recorded (the merge places work by it), never explored
        key = _value_key(proxy.node)
        forced = self.answered.get(key)
        if not self.site_open:
            self.site, self.history, self.site_open = self.site + 1, [], True
        if not self.history:
            self.site_location = location  # a chain is explored by where it starts
        answer = self.policy(self.site_location, tuple(self.history)) if forced is None else forced
        self.conditions.append(
            mode_paths.Condition(
                proxy.node,
                self.site,
                len(self.history),
                reader,
                self.last_data,
                answer,
                self.site_location,
                forced=forced is not None,
            )
        )
        self.history.append(answer)
        self.answered.setdefault(key, answer)
        return answer


def _value_key(n: fx.Node, depth: int = 0) -> Any:
    """What a flag or number value is computed from, as data: two reads of one module's `training` or of one number
    attribute are one value (a forward does not change them while it runs), and so is the same arithmetic of them."""
    if n.op == "get_attr":
        return ("get_attr", n.target)
    if n.op not in ("call_function", "call_method") or depth > 8:
        return n

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return _value_key(a, depth + 1)
        return a if isinstance(a, (int, float, bool, str, type(None))) else id(a)

    return (n.op, n.target, tuple(arg(a) for a in n.args), tuple(sorted((k, arg(v)) for k, v in n.kwargs.items())))


def _trace_once(model: nn.Module, tracer: _Tracer, fixed: dict[str, Any]) -> fx.Graph:
    with WatchModules(model, tracer), RecordConstructors(tracer), RecordLegacyMakers(tracer, model), _kept(model):
        return tracer.trace(model, concrete_args=fixed or None)


_MODULE_OWN = frozenset(nn.Module().__dict__)  # nn.Module's own tables (_parameters, hooks): not the model's state


@contextlib.contextmanager
def _kept(model: nn.Module) -> Iterator[None]:
    """The dicts, lists and sets the model's modules hold, as they were before a trace: a cache a forward fills on
    first use (LeViT's attention_bias_cache, filled in eval mode) would otherwise hold the trace's proxies, which the
    next trace (another path through a block's branches) reads back as work done, and the model keeps."""
    saved = [
        (v, type(v)(v))
        for m in model.modules()
        for k, v in vars(m).items()
        if k not in _MODULE_OWN and type(v) in (dict, list, set)
    ]
    try:
        yield
    finally:
        for v, old in saved:
            v.clear()
            v.update(old) if isinstance(v, (dict, set)) else v.extend(old)


class _Shallow(_Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True  # the top-level forward only: every module it calls stays whole


def tracer_stack_top(tracer: _Tracer) -> tuple[str, str]:
    if not tracer.stack:
        return "", ""
    return tracer.stack[-1]
