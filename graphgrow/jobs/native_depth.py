"""as_native for a grown stack of layers (deepen(block=copy)): the layers numbered in the order the grown graph runs
them, the config's layer count and its per-layer lists (layer_types, …) following them.

The pass registers a copy under the next free index of its stack (`model.layers.{n}`: every parameter keeps its
name) and records in the graph's metadata which layer it copied (`layer_copies`: copy's path → source's path). Here:
1. the stack's layers in run order: the first node of each in the grown graph (by call target or recorded scope);
2. each layer's origin: an original layer keeps its index, a copy takes its source's (a copy of a copy, its source's);
3. the state dict renamed to the run order, `{stack}.{position}.…`;
4. the config: the integer field holding the layer count (the one whose value, set to the new count, gives the class
   a layer at the new last index, found on the meta device), and every list of one entry per layer, each entry
   taken from the layer's origin.
5. the check again, on a copy of the grown graph whose copied layers' zero tensors (their output projections) hold
   random values: a copy is the identity until it learns, so only then does the check see whether the class runs it
   as the graph does (a layer that depends on its index, such as GPT-2's scale_attn_by_inverse_layer_idx, is refused).
The metadata is read as untrusted (a loaded file): paths must name numbered layers of the grown model.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import NotApplicable
from ..graph.fx_edit import copy_graph_module, sharing_parameters
from ..graph.graph_meta import graph_info, scope_of

COPIES_KEY = "layer_copies"
_NOT_PER_LAYER = {"architectures"}  # lists a config holds for other reasons than one entry per layer


@dataclass
class Deeper:
    stack: str  # the container path, e.g. model.layers
    before: int  # the original's layer count
    order: list[int]  # the grown stack's indices in run order
    origin: dict[int, int]  # grown index → the original layer it comes from

    def position(self, index: int) -> int:
        return self.order.index(index)


def _numbered(module: nn.Module) -> list[int]:
    return sorted(int(k) for k, m in module.named_children() if k.isdigit() and any(True for _ in m.parameters()))


def deeper_stacks(grown: fx.GraphModule, original: nn.Module) -> list[Deeper]:
    """The stacks a layer copy deepened, from the grown graph's record ([] when none)."""
    copies = graph_info(grown).get(COPIES_KEY) or {}
    if not isinstance(copies, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in copies.items()):
        raise NotApplicable("the grown model's record of copied layers is malformed", "keep the GraphModule")
    out = []
    for stack in sorted({k.rpartition(".")[0] for k in copies}):
        try:
            before = _numbered(original.get_submodule(stack))
            now = _numbered(grown.get_submodule(stack))
        except AttributeError as e:
            raise NotApplicable(
                f"the copied layers' stack {stack!r} is not in the models", "keep the GraphModule"
            ) from e
        origin: dict[int, int] = {i: i for i in before}
        for i in now:
            origin[i] = _source(stack, i, origin, copies, set(now), ())
        first: dict[int, int] = {}
        for k, n in enumerate(grown.graph.nodes):
            paths = [*scope_of(n), *([str(n.target)] if n.op in ("call_module", "get_attr") else [])]
            for i in now:
                if i not in first and any(p == f"{stack}.{i}" or p.startswith(f"{stack}.{i}.") for p in paths):
                    first[i] = k
        if set(first) != set(now):
            raise NotApplicable(f"layers of {stack} do not run in the grown graph", "keep the GraphModule")
        out.append(Deeper(stack, len(before), sorted(now, key=first.__getitem__), origin))
    return out


def _source(stack: str, i: int, origin: dict[int, int], copies: dict, now: set[int], seen: tuple[int, ...]) -> int:
    """The original layer that layer `i` of `stack` comes from: itself, or what its source came from."""
    if i in origin:
        return origin[i]
    head, _, index = str(copies.get(f"{stack}.{i}", "")).rpartition(".")
    if head != stack or not index.isdigit() or int(index) in seen or int(index) not in now:
        raise NotApplicable(f"layer {stack}.{i} has no original it was copied from", "keep the GraphModule")
    return _source(stack, int(index), origin, copies, now, (*seen, i))


def original_path(path: str, deeper: list[Deeper]) -> str:
    """A grown module path as the original names its layer (a copy: the layer it was copied from)."""
    for d in deeper:
        head = d.stack + "."
        if path.startswith(head):
            index, _, rest = path[len(head) :].partition(".")
            if index.isdigit():
                return f"{head}{d.origin[int(index)]}" + (f".{rest}" if rest else "")
    return path


def in_run_order(state: dict[str, Any], deeper: list[Deeper]) -> dict[str, Any]:
    """The state dict with each deepened stack's layers numbered in the order they run."""
    out = dict(state)
    for d in deeper:
        pattern = re.compile(rf"^{re.escape(d.stack)}\.(\d+)\.(.+)$")
        renamed = {}
        for k in list(out):
            m = pattern.match(k)
            if m:
                renamed[f"{d.stack}.{d.position(int(m[1]))}.{m[2]}"] = out.pop(k)
        out.update(renamed)
    return out


def deeper_config(config: Any, cls: type, deeper: list[Deeper], shapes: Callable[[type, Any], dict | None]) -> Any:
    """The original config with each deepened stack's layer count and per-layer lists (`shapes(cls, config)`: the
    state-dict shapes of the class built on the meta device, None when it cannot be built)."""
    config = copy.deepcopy(config)
    for d in deeper:
        n0, n1 = d.before, len(d.order)
        fields = config.to_dict()
        lists = [k for k, v in fields.items() if isinstance(v, list) and len(v) == n0 and k not in _NOT_PER_LAYER]
        counts = [k for k, v in fields.items() if type(v) is int and v == n0 and not k.startswith("_")]
        for field in counts:
            probe = copy.deepcopy(config)
            try:
                setattr(probe, field, n1)
                for k in lists:
                    old = getattr(config, k)
                    setattr(probe, k, [old[d.origin[i]] for i in d.order])
            except Exception:  # noqa: BLE001 - a typed field that refuses the value does not hold the count
                continue
            built = shapes(cls, probe)
            if built and any(k.startswith(f"{d.stack}.{n1 - 1}.") for k in built):
                config = probe
                break
        else:
            raise NotApplicable(
                f"no field of {type(config).__name__} sets the number of layers in {d.stack} ({n0} → {n1})",
                "keep the GraphModule",
            )
    return config


def copies_moved(grown: fx.GraphModule, deeper: list[Deeper]) -> fx.GraphModule:
    """The grown graph copied, its copied layers' all-zero tensors holding random values (seeded), as after training;
    every other parameter shares its storage with `grown` (the check costs the moved tensors, not a model)."""
    with sharing_parameters():
        moved = copy_graph_module(grown)
    generator = torch.Generator().manual_seed(0)
    for d in deeper:
        for i in d.order:
            if i < d.before:
                continue  # an original layer: already checked as it is
            for module in moved.get_submodule(f"{d.stack}.{i}").modules():
                for name, p in list(module.named_parameters(recurse=False)):
                    if p.is_floating_point() and not p.any():
                        std = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1
                        value = (torch.randn(p.shape, generator=generator) * std).to(p)
                        module._parameters[name] = nn.Parameter(value, requires_grad=p.requires_grad)
    return moved


def check_moved(
    grown: fx.GraphModule,
    native: nn.Module,
    deeper: list[Deeper],
    class_state: Callable[[fx.GraphModule], dict[str, Any]],
    check: Callable[[fx.GraphModule, nn.Module], None],
) -> None:
    """as_native's check once more, the copied layers moved (copies_moved) on both sides: `class_state(g)` is a
    graph's state in the class's names and layout, `check(g, m)` the comparison, NotApplicable when they differ.
    The native model takes the moved tensors for the check and gets its own back after it."""
    moved = copies_moved(grown, deeper)
    own = native.state_dict()
    changed = {k: v for k, v in class_state(moved).items() if k in own and not torch.equal(own[k], v)}
    saved = {k: own[k].clone() for k in changed}
    native.load_state_dict(changed, strict=False)
    try:
        check(moved, native)
    except NotApplicable as e:
        raise NotApplicable(
            f"{type(native).__name__} would run the copied layers otherwise than the grown graph once they learn "
            f"({e.message}): the layer depends on its place in the stack (e.g. GPT-2's "
            "scale_attn_by_inverse_layer_idx)",
            "keep the GraphModule",
        ) from e
    finally:
        native.load_state_dict(saved, strict=False)
