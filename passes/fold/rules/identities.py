"""Rule family: ops that are the identity in eval mode (nn.Identity, dropout, drop-path, a parameter-free
leaf that hands back its input, a mode switch whose eval-mode path is the identity) are bypassed."""

from __future__ import annotations

from typing import Any

import torch
from graphgrow.passes.fold.graph import bypass, module_of  # noqa: TID251 (the fold package's own module)
from torch import fx, nn

from graphgrow.rewrite import eval_passthrough, tensor_shape

# dropout-like functions → the position of their `training` argument (torchvision's stochastic_depth has `mode` first)
_DROPOUT_FNS = {
    "dropout": 2,
    "dropout1d": 2,
    "dropout2d": 2,
    "dropout3d": 2,
    "alpha_dropout": 2,
    "feature_alpha_dropout": 2,
    "stochastic_depth": 3,
    "drop_path": 2,
}


def _fn_training_arg(n: fx.Node, index: int) -> Any:
    """The `training` argument of a dropout-like function call (default True, as in torch)."""
    if "training" in n.kwargs:
        return n.kwargs["training"]
    return n.args[index] if len(n.args) > index else True


def _is_identity(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Ops that are the identity in eval mode."""
    if n.op == "call_module":
        m = module_of(gm, n)
        if isinstance(
            m,
            (
                nn.Identity,
                nn.Dropout,
                nn.Dropout1d,
                nn.Dropout2d,
                nn.Dropout3d,
                nn.AlphaDropout,
                nn.FeatureAlphaDropout,
            ),
        ):
            return True
        return _returns_its_input(m, n)
    if n.op == "call_function" and getattr(n.target, "__name__", "") in _DROPOUT_FNS:
        return _fn_training_arg(n, _DROPOUT_FNS[n.target.__name__]) is False
    return False


def _returns_its_input(m: nn.Module | None, n: fx.Node) -> bool:
    """A parameter-free leaf (drop-path, say) that hands back its very input object in eval mode."""
    if m is None or next(m.parameters(), None) is not None or len(n.args) != 1 or n.kwargs:
        return False
    shape = tensor_shape(n.args[0]) if isinstance(n.args[0], fx.Node) else None
    if shape is None or tensor_shape(n) != shape:
        return False
    x = torch.zeros((1, *shape[1:]), dtype=n.args[0].meta.get("gg_dtype") or torch.float32)
    try:
        with torch.no_grad():
            return m.eval()(x) is x
    except Exception:
        return False


def remove_identities(gm: fx.GraphModule) -> int:
    count = 0
    for n in list(gm.graph.nodes):
        if _is_identity(gm, n) and n.args and isinstance(n.args[0], fx.Node):
            bypass(n, n.args[0])
            count += 1
        elif (kept := eval_passthrough(gm, n)) is not None:  # a merged block's train-only work (drop-path)
            bypass(n, kept)
            count += 1
    return count
