"""A model's own layer that computes exactly what a torch.nn layer computes, judged by running it.

Hugging Face models bring their own small layers: GPT-2's `Conv1D` is a Linear whose weight is stored
transposed (x @ W + b); `LlamaRMSNorm` and `T5LayerNorm` are RMSNorm over the last axis, Gemma's RMSNorm one with
weight 1 + w. Passes and
the coupling analysis know torch.nn layers, so export capture raises such a layer back as the
torch.nn layer it behaves as — decided by running both on random inputs (in eval and train mode,
at two scales so that an RMSNorm's eps is pinned), never by the class name. A layer that matches
nothing stays as the functions it was exported to.

The stand-in shares the layer's parameters where the layout is the same (an RMSNorm's weight, a
bias); a transposed weight is a copy in Linear's layout (out × in).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

_MAX_PROBE = 1 << 22  # weight elements probed at most: a larger layer stays as its functions


def standin(m: nn.Module, shared: set[int] = frozenset()) -> nn.Module | None:  # type: ignore[assignment]
    """The torch.nn layer that computes what `m` computes (a Linear, an RMSNorm or a LayerNorm), or None.

    `shared`: ids of parameters another module also holds (tied): those are never copied."""
    if type(m).__module__.startswith("torch.nn.") or any(True for _ in m.children()) or any(True for _ in m.buffers()):
        return None
    params = dict(m.named_parameters(recurse=False))
    weight = params.get("weight")
    if (
        weight is None
        or not weight.is_floating_point()
        or weight.numel() > _MAX_PROBE
        or set(params) - {"weight", "bias"}
    ):
        return None
    bias = params.get("bias")
    try:
        if weight.dim() == 2 and (bias is None or bias.shape == weight.shape[1:] or bias.shape == weight.shape[:1]):
            return _linear(m, weight, bias, id(weight) in shared)
        if weight.dim() == 1 and bias is None and (found := _rms_norm(m, weight)) is not None:
            return found
        if weight.dim() == 1 and (bias is None or bias.shape == weight.shape):
            return _layer_norm(m, weight, bias)
    except Exception:  # noqa: BLE001 - a layer that fails on a probe input is not this kind of layer
        return None
    return None


def _linear(m: nn.Module, weight: nn.Parameter, bias: nn.Parameter | None, tied: bool) -> nn.Module | None:
    """A Linear with weight W (out × in) or with the transposed weight (GPT-2's Conv1D stores in × out)."""
    for transposed in (False, True):
        out_f, in_f = weight.shape[::-1] if transposed else weight.shape
        if (transposed and tied) or (bias is not None and bias.shape != (out_f,)):
            continue
        w = weight.detach().t() if transposed else weight.detach()
        pw, pb = _probed(w), None if bias is None else _probed(bias)
        if _matches(m, (in_f,), lambda x, w=pw, b=pb: F.linear(x, w, b)):
            lin = nn.Linear(in_f, out_f, bias=bias is not None, device="meta", dtype=weight.dtype)
            lin.weight = (
                nn.Parameter(w.contiguous().clone(), requires_grad=weight.requires_grad) if transposed else weight
            )
            if bias is not None:
                lin.bias = bias
            return lin
    return None


def _rms_norm(m: nn.Module, weight: nn.Parameter) -> nn.Module | None:
    """An RMSNorm over the last axis: x / sqrt(mean(x²) + eps) · weight, eps one of the layer's own numbers; or
    · (1 + weight) (Gemma's RMSNorm stores the scale's offset from 1): then the stand-in's weight is a copy, 1 + w
    (offset_weight() gives the layer's own layout back)."""
    d = weight.shape[0]
    for offset in (0.0, 1.0):
        # a half-precision layer adds the 1 in float32 (Gemma: 1.0 + self.weight.float()): 1 + w is kept in float32,
        # where it is exact, not rounded to the layer's dtype
        w = _probed(weight) + offset if offset else weight.detach()
        for eps in _eps_candidates(m):
            probe = _probed(w)
            if _matches(m, (d,), lambda x, eps=eps, w=probe: F.rms_norm(x, (d,), w, eps), scales=(1.0, eps**0.5)):
                norm = nn.RMSNorm(d, eps=eps, device="meta", dtype=weight.dtype)
                norm.weight = nn.Parameter(w.clone(), requires_grad=weight.requires_grad) if offset else weight
                return norm
    return None


def _layer_norm(m: nn.Module, weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Module | None:
    """A LayerNorm over the last axis written out by hand ((x - mean) / sqrt(var + eps) · weight (+ bias): DeBERTa's,
    Cohere's without a bias), eps one of the layer's own numbers."""
    d = weight.shape[0]
    for eps in _eps_candidates(m):
        w, b = _probed(weight), None if bias is None else _probed(bias)
        if _matches(m, (d,), lambda x, eps=eps, w=w, b=b: F.layer_norm(x, (d,), w, b, eps), scales=(1.0, eps**0.5)):
            norm = nn.LayerNorm(d, eps=eps, bias=bias is not None, device="meta", dtype=weight.dtype)
            norm.weight = weight
            if bias is not None:
                norm.bias = bias
            return norm
    return None


def offset_weight(own: nn.Module, raised: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A grown stand-in RMSNorm's `weight` in the layer's own layout: minus 1 where the layer scales by 1 + w."""
    return (
        weight - 1 if isinstance(raised, nn.RMSNorm) and raised.weight is not getattr(own, "weight", None) else weight
    )


def _probed(t: torch.Tensor) -> torch.Tensor:
    """A tensor as the probe computes with it: a half-precision one in float32 (_matches)."""
    return t.detach().float() if t.dtype in (torch.bfloat16, torch.float16) else t.detach()


def _eps_candidates(m: nn.Module) -> Iterator[float]:
    seen = set()
    for v in vars(m).values():
        if type(v) is float and 0 < v < 1e-1 and v not in seen:
            seen.add(v)
            yield v


def _matches(m: nn.Module, last: tuple[int, ...], expected, scales: tuple[float, ...] = (1.0,)) -> bool:
    """`m(x)` equals `expected(x)` (to fp32 rounding) on seeded inputs (2, 3, *last), in eval and train mode.
    A bfloat16/float16 layer is compared in float32 on its stored values (its own float32 copy, this layer only):
    the function is what is asked; where each op rounds in the half dtype is not (LlamaRMSNorm rounds before its
    scale, F.rms_norm after it)."""
    p = next(m.parameters())
    half = p.dtype in (torch.bfloat16, torch.float16)
    dtype = torch.float32 if half else p.dtype
    state = {k: v.float() for k, v in m.named_parameters()} if half else {}
    g = torch.Generator().manual_seed(0)
    was = m.training
    try:
        with torch.no_grad():
            for scale in scales:
                x = (torch.randn((2, 3, *last), generator=g) * scale).to(device=p.device, dtype=dtype)
                want = expected(x)
                for mode in (False, True):
                    m.train(mode)
                    got = functional_call(m, state, (x,)) if half else m(x)
                    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                        return False
                    tol = 1e-5 * float(want.abs().max()) + 1e-30
                    if not bool(((got - want).abs() <= tol).all()):
                        return False
        return True
    finally:
        m.train(was)


def tied_parameters(model: nn.Module) -> set[int]:
    """Ids of parameters that more than one module holds (tied weights)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, v in seen.items() if v > 1}
