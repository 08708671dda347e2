"""The grown model as a copy of the user's own module (timm, torchvision, a user's class) where growth only resized
layers (grow_width, grow_hidden, grow_heads): the original is deep-copied and each torch.nn layer whose parameters
or buffers the growth resized is replaced by the grown layer at the same path (its sizes, groups and eps as the
pass rebuilt them). The copy keeps the class and its other methods (timm's forward_features, reset_classifier; a
user's helpers). It is checked against the grown graph on the recorded input, in eval and train mode; a forward
that bakes a size in (a reshape to a constant width) fails that check and is refused, as is structural growth (a
module the original has no place for: a branch, an inserted block), which stays a GraphModule.

Size attributes that the class keeps outside its layers (timm's `num_features`, a user's `self.width`) are updated
only where they held the replaced layer's old size on the root module and name a feature count (see
`_size_attributes`); others are left as they were, and the report says which.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import GraphgrowError, NotApplicable
from ..core.protocol import compare_outputs
from ..graph.graph_meta import input_spec_of
from ..graph.shapes import example_input


def resized_copy(grown: fx.GraphModule, original: nn.Module) -> nn.Module:
    """A copy of `original` with the grown layers in place (module docstring); NotApplicable naming what does not
    map."""
    before = dict(original.state_dict())
    after = dict(grown.state_dict())
    extra = sorted(k for k in after if k not in before)
    if extra:
        raise NotApplicable(
            f"the growth adds {', '.join(extra[:3])}"
            + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
            + f": {type(original).__name__} has no place for it (structural growth stays a GraphModule)",
            "keep the GraphModule (it saves, loads and exports as it is)",
        )
    changed = sorted(k for k in after if after[k].shape != before[k].shape)
    native = copy.deepcopy(original)
    replaced = {}
    for key in changed:
        path = key.rpartition(".")[0]
        if path in replaced:
            continue
        try:
            new = grown.get_submodule(path)
            old = native.get_submodule(path)
        except AttributeError:
            raise NotApplicable(
                f"'{key}' changed size and the grown graph has no layer '{path}' holding it", "keep the GraphModule"
            ) from None
        if type(new) is not type(old) or not _is_layer(old):
            raise NotApplicable(
                f"'{path}' is a {type(old).__name__} in {type(original).__name__} and a "
                f"{type(new).__name__} in the grown graph: only torch.nn layers (or subclasses of one, such as "
                "timm's BatchNormAct2d) are swapped back",
                "keep the GraphModule",
            )
        replaced[path] = (old, new)
        _swap(native, path, copy.deepcopy(new))
    with torch.no_grad():  # what the growth changed in place, at the same sizes (a rescaled norm, new values)
        own = native.state_dict()
        for k, v in after.items():
            if k in own and own[k].shape == v.shape:
                own[k].copy_(v)
    _size_attributes(native, replaced)
    _head_attributes(grown, native)
    _check(grown, native)
    return native


_CONTAINERS = (nn.Module, nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _is_layer(m: nn.Module) -> bool:
    """A torch.nn layer, or a subclass of one (timm's BatchNormAct2d is a BatchNorm2d with its activation): the pass
    resized it as that layer (graph/fx_edit rebuilds by type), and the grown graph called this very module, of the
    same class, so swapping it in computes what the graph does (and _check says so)."""
    return any(c.__module__.startswith("torch.nn.modules.") and c not in _CONTAINERS for c in type(m).__mro__)


def _head_attributes(grown: fx.GraphModule, native: nn.Module) -> None:
    """An attention module's own head counts and head size (timm's Attention reshapes by self.num_heads): set on
    the module holding each grown attention's projections, for integer attributes named for heads, from what the
    heads analysis reads in the grown graph."""
    from ..analysis.heads import find_attentions

    try:
        attentions = find_attentions(grown, set())
    except NotApplicable:
        return
    for a in attentions:
        paths = {p.module.rpartition(".")[0] for p in a.projections if p.module}
        for path in paths:
            try:
                holder = native.get_submodule(path)
            except AttributeError:
                continue
            for name, value in list(vars(holder).items()):
                if not isinstance(value, int) or isinstance(value, bool) or "head" not in name:
                    continue
                if "dim" in name or "size" in name:
                    setattr(holder, name, a.head_dim)
                elif "kv" in name or "key_value" in name:
                    setattr(holder, name, a.kv_heads)
                else:
                    setattr(holder, name, a.heads)


def _swap(root: nn.Module, path: str, layer: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, layer)


_FEATURE_WORDS = ("num_features", "embed_dim", "hidden_size", "width", "channels", "dim", "head_hidden_size")


def _size_attributes(native: nn.Module, replaced: dict) -> None:
    """Root attributes named as feature counts that held the input width of a replaced classifier (the last Linear
    whose in_features grew): timm's num_features and head_hidden_size."""
    linears = [
        (old, new)
        for old, new in replaced.values()
        if isinstance(new, nn.Linear) and old.in_features != new.in_features
    ]
    if not linears:
        return
    old, new = linears[-1]
    for name, value in list(vars(native).items()):
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and value == old.in_features
            and any(w in name for w in _FEATURE_WORDS)
        ):
            setattr(native, name, new.in_features)


def _check(grown: fx.GraphModule, native: nn.Module) -> None:
    """Eval and train mode on the recorded input, the same seed for each; buffers a train-mode forward moves
    (BatchNorm's running statistics) are put back afterwards in both models."""
    spec = input_spec_of(grown)
    kept = [(b, b.detach().clone()) for m in (grown, native) for b in m.buffers()]
    try:
        _compare(grown, native, spec)
    finally:
        with torch.no_grad():
            for b, v in kept:
                b.copy_(v)


def _compare(grown: fx.GraphModule, native: nn.Module, spec: Any) -> None:
    for train in (False, True):
        x = example_input(grown, spec, seed=1, batch=2)
        was_g, was_n = grown.training, native.training
        grown.train(train)
        native.train(train)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                want = grown(**x) if isinstance(x, dict) else grown(x)
                torch.manual_seed(0)
                got = native(**x) if isinstance(x, dict) else native(x)
        except Exception as e:  # noqa: BLE001 - the class's forward refuses the grown sizes
            raise NotApplicable(
                f"{type(native).__name__} with the grown layers does not run: {type(e).__name__}: "
                f"{' '.join(str(e).split())[:200]}",
                "keep the GraphModule",
            ) from e
        finally:
            grown.train(was_g)
            native.train(was_n)
        mode = "train" if train else "eval"
        try:  # the project's one check protocol (core.protocol): every output tensor, its tolerance
            check = compare_outputs(want, got, mode)
        except GraphgrowError as e:
            raise NotApplicable(
                f"{type(native).__name__} with the grown layers gives other outputs than the grown graph ({e.message})",
                "keep the GraphModule",
            ) from e
        if not check.ok:
            raise NotApplicable(
                f"{type(native).__name__} with the grown layers does not compute what the grown graph "
                f"does in {mode} mode (relative error {check.rel_err:.3g}): its forward holds a size "
                "the layers do not",
                "keep the GraphModule",
            )
    native.train(grown.training)
