"""`--weights FILE.safetensors`: trained weights for a model built by name (timm:NAME, torchvision:NAME, hf:TYPE,
package.module:factory). The name builds the architecture (random weights, as always); the state dict is then read
from a safetensors file — never a pickle — whose size is checked from its header against --max-load before any tensor
is read (hf_folder.stored_bytes), and loaded strictly: a missing, unexpected or differently shaped key is a LoadError
naming the first few, so a checkpoint of another model never half-loads. A model file or folder carries its own
weights and is refused with --weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..core.errors import LoadError, SpecError
from .hf_folder import stored_bytes

SHOWN = 3  # keys named in an error


def refuse_weights_for(source: str, weights: str, is_name: bool) -> None:
    """Before anything is loaded: --weights goes with a model name and a .safetensors file only."""
    if not is_name:
        raise SpecError(
            f"--weights is for a model built by name; {source[:200]} is a model file or folder, which carries its "
            "own weights",
            "drop --weights, or name the model (timm:NAME, torchvision:NAME, package.module:factory) and pass its "
            "weights with --weights",
        )
    if Path(weights).suffix.lower() != ".safetensors":
        raise SpecError(
            f"--weights {weights[:200]}: graphgrow reads weights from .safetensors files only (pickled .pt/.bin "
            "files can run code)",
            "convert it once where you trust it: safetensors.torch.save_file(torch.load(f), 'w.safetensors')",
        )


def load_weights(model: nn.Module, weights: str, limit: int, source: str) -> None:
    """Fill `model` (built by name) from the safetensors file `weights`, strictly; LoadError otherwise."""
    path = Path(weights)
    if not path.is_file():
        raise LoadError(f"--weights {weights[:200]}: no such file", "check the path")
    size, count, _ = stored_bytes([path])  # the header only: nothing is allocated yet
    if size > limit:
        raise LoadError(
            f"{weights[:200]} holds {count:,} values ({size / 2**20:,.1f} MiB; limit {limit / 2**20:,.1f} MiB); "
            "nothing was read",
            "raise the limit with --max-load SIZE",
        )
    if size > path.stat().st_size:
        raise LoadError(
            f"{weights[:200]} is truncated or its header lies: it declares {size:,} bytes of tensors in a file of "
            f"{path.stat().st_size:,} bytes",
            "save the weights again with safetensors.torch.save_file",
        )
    from safetensors.torch import load_file

    try:
        state = load_file(str(path), device="cpu")
    except Exception as e:  # safetensors checks offsets against the file; any failure is a bad file
        raise LoadError(
            f"{weights[:200]} is not a valid safetensors file: {' '.join(str(e).split())[:200]}",
            "save the weights again with safetensors.torch.save_file",
        ) from e
    _check_matches(model, state, weights, source)
    with torch.no_grad():
        model.load_state_dict(state, strict=False)  # checked above: only a tied tensor's other names are absent


def _check_matches(model: nn.Module, state: dict[str, torch.Tensor], weights: str, source: str) -> None:
    own = model.state_dict()
    # tied parameters (an LM head sharing the embedding) are one tensor under two names, and safetensors keeps one
    # of them (save_model drops the others): a name is there when any name of its tensor is
    names: dict[tuple[int, tuple[int, ...]], set[str]] = {}
    for k, t in own.items():
        if t.numel():
            names.setdefault((t.data_ptr(), tuple(t.shape)), set()).add(k)
    missing = [
        k
        for k in own
        if k not in state and not names.get((own[k].data_ptr(), tuple(own[k].shape)), set()) & state.keys()
    ]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {list(state[k].shape)} (the model's: {list(own[k].shape)})"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    problems = []
    for what, keys in (("missing", missing), ("unexpected", unexpected), ("with another shape", shapes)):
        if keys:
            more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
            problems.append(f"{len(keys)} {what}: {', '.join(keys[:SHOWN])}{more}")
    if problems:
        raise LoadError(
            f"{weights[:200]} does not fit {source[:200]}: " + "; ".join(problems),
            "pass the weights saved from this very model (model.state_dict()), with the same name and arguments",
        )
