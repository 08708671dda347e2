"""What a model sharded with FSDP2 is made of, read back and copied (fsdp.py and fsdp_layers.py grow it): whether a
module is sharded, its units (`sharding_units`: module paths and settings of each fully_shard call), the grown
model's units (`plan_units`), every unit back to its shards (`reshard_all`), and a plain copy with the full values or
the structure on the meta device (`unsharded_copy`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

# what nn.Module.__init__ makes: a plain copy gets its own, empty hooks included (FSDP's hooks stay on the original)
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def is_fsdp(model: Any) -> bool:
    """Whether `model` is a module FSDP2's fully_shard has been applied to."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


@dataclass
class Unit:
    """One fully_shard call to repeat on the grown model: the paths of its modules and its settings."""

    paths: tuple[str, ...]
    options: dict[str, Any]


def sharding_units(model: nn.Module) -> list[Unit]:
    """The fully_shard calls that made `model`, read back from FSDP2's state (innermost first, the root last):
    module paths, mesh, reshard_after_forward, mixed precision and offload policy. A custom shard_placement_fn
    cannot be read back (the grown model is sharded on dim 0)."""
    from torch.distributed.fsdp import FSDPModule

    paths = {id(m): p for p, m in model.named_modules()}
    units, seen = [], set()
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        if id(state) in seen:
            continue
        seen.add(id(state))
        group = state._fsdp_param_group
        if group is None:  # a unit with no parameters of its own: nothing to shard again
            continue
        options: dict[str, Any] = {
            "mesh": group.mesh_info.mesh,
            "mp_policy": group.mp_policy,
            "offload_policy": group.offload_policy,
        }
        if not state._auto_reshard_after_forward:
            post = group.post_forward_mesh_info
            options["reshard_after_forward"] = (
                False if post is None else True if post is group.mesh_info else post.shard_mesh_size
            )
        units.append(Unit(tuple(paths[id(x)] for x in state._modules), options))
    return sorted(units, key=lambda u: (u.paths == ("",), -min(p.count(".") for p in u.paths)))


def _reshard_all(model: nn.Module) -> None:
    """Every unit back to its shards: a unit that keeps its gathered parameters after forward (the root by default)
    has plain tensors registered until the next backward, and the optimiser holds the DTensor shards."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def plan_units(
    units: list[Unit], present: set[str], called: list[str], with_params: set[str], before: set[str]
) -> list[Unit]:
    """The grown model's units: each old unit with its modules that are still there (by path: a pass that resizes a
    layer puts the new one at the same path), then one unit per new top-level module (passes name what they add at
    the root, e.g. deepen's `deepen_transformer`) made of the leaves the graph calls under it that hold parameters,
    with the layer units' options — a new layer is sharded like the others rather than joining the root's unit,
    which stays gathered through the whole step. The root's unit last."""
    kept = [Unit(tuple(p for p in u.paths if p in present), u.options) for u in units[:-1]]
    kept = [u for u in kept if u.paths]
    claimed = {p for u in kept for p in u.paths}
    added: dict[str, list[str]] = {}
    for path in called:
        if path not in before and path not in claimed and path in with_params:
            added.setdefault(path.split(".")[0], []).append(path)
    options = kept[-1].options if kept else units[-1].options
    new_units = [Unit(tuple(paths), options) for paths in added.values()] if kept else []
    return [*kept, *new_units, units[-1]]


def unsharded_copy(model: fx.GraphModule, meta: bool = False) -> fx.GraphModule:
    """A plain GraphModule with `model`'s graph, modules, buffers and metadata and its parameters' full values, on
    every rank: each DTensor parameter is gathered in turn (a collective: every rank walks the same order). Tied
    parameters stay tied; `model` is not changed. `meta`: the structure only — every tensor on the meta device with
    its full shape, nothing gathered (no collective)."""
    params: dict[int, nn.Parameter] = {}
    mods: dict[int, nn.Module] = {}
    holder = nn.Module()
    for name, child in model.named_children():
        holder.add_module(name, _plain(child, params, mods, meta))
    for name, p in model._parameters.items():
        holder.register_parameter(name, _full(p, params, meta))
    for name, b in model._buffers.items():
        holder.register_buffer(name, _buffer(b, meta), name not in model._non_persistent_buffers_set)
    gm = fx.GraphModule(holder, _deepcopy(model.graph), class_name=_original_class(model).__name__)
    gm.meta = _deepcopy(model.meta)
    gm.train(model.training)
    return gm


def _deepcopy(value: Any) -> Any:
    return copy.deepcopy(value)  # a Graph copies its nodes, not the module that owns it


def _original_class(m: nn.Module) -> type:
    """The class fully_shard swapped out (it puts FSDP<Class> with FSDPModule in front of it)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(m).__mro__ if not issubclass(c, FSDPModule))


def _buffer(b: torch.Tensor | None, meta: bool) -> torch.Tensor | None:
    if b is None:
        return None
    return torch.empty(b.shape, dtype=b.dtype, device="meta") if meta else b.detach().to("cpu", copy=True)


def _full(p: Any, memo: dict[int, nn.Parameter], meta: bool = False) -> Any:
    if p is None:
        return None
    if id(p) not in memo and meta:
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
    if id(p) not in memo:
        from torch.distributed.tensor import DTensor

        # on the host: the accelerator holds one gathered tensor at a time, and fully_shard moves the grown model
        # back one unit at a time (it moves a unit's tensors to the mesh's device, then keeps only the shard)
        data = p.full_tensor().to("cpu") if isinstance(p, DTensor) else p.detach().to("cpu", copy=True)
        memo[id(p)] = nn.Parameter(data.detach(), p.requires_grad)
    return memo[id(p)]


def _plain(m: nn.Module, params: dict[int, nn.Parameter], mods: dict[int, nn.Module], meta: bool) -> nn.Module:
    """`m` and its children as their own classes: fresh hooks, full parameters, copied buffers and attributes."""
    if id(m) in mods:
        return mods[id(m)]
    cls: Any = _original_class(m)
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for key, value in vars(m).items():
        if key in _MODULE_INTERNALS or key.startswith(("_fsdp", "_is_fsdp", "__composable")):
            continue
        object.__setattr__(new, key, _deepcopy(value))
    new.training = m.training
    for name, p in m._parameters.items():
        new._parameters[name] = _full(p, params, meta)
    for name, b in m._buffers.items():
        new._buffers[name] = _buffer(b, meta)
    new._non_persistent_buffers_set = set(m._non_persistent_buffers_set)
    mods[id(m)] = new
    for name, child in m._modules.items():
        new._modules[name] = None if child is None else _plain(child, params, mods, meta)
    return new
