"""Temporary model state: training mode, buffers and RNG, restored on exit.

Verification runs forwards in train mode (which updates BatchNorm running stats and
draws dropout masks) on modules that may be shared with the caller's model. These
context managers make such runs leave no trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import fx, nn


@contextlib.contextmanager
def training_mode(module: nn.Module, training: bool) -> Iterator[nn.Module]:
    """Set every submodule's training flag, and put each one back afterwards."""
    saved = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield module
    finally:
        for m, flag in saved:
            m.training = flag


@contextlib.contextmanager
def dropout_off(module: nn.Module) -> Iterator[nn.Module]:
    """Dropout layers act as the identity (restored afterwards).

    Train-mode preservation is checked with dropout off: its masks are drawn per
    element, so a wider tensor draws different masks for the old channels too; the
    function is the same in distribution, not sample by sample.
    """
    drops: list[tuple[nn.Module, bool]] = [
        (m, m.training) for m in module.modules() if isinstance(m, nn.modules.dropout._DropoutNd)
    ]
    drops += [(m, m.training) for m in _dropout_flags(module)]
    for m, _ in drops:
        m.training = False
    try:
        yield module
    finally:
        for m, flag in drops:
            m.training = flag


def _dropout_flags(module: nn.Module) -> list[nn.Module]:
    """Modules of a captured graph whose `training` flag is read only to drive dropout (the attention dropout
    inside scaled_dot_product_attention: `dropout_p = training * p`; a traced-through `F.dropout(x, p,
    training=self.training)`) and which are not called themselves: their dropout goes off with the dropout
    layers (adding heads or channels draws other masks for the old ones too)."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return []
    called = {n.target for n in graph.nodes if n.op == "call_module"}
    reads: dict[str, bool] = {}
    for n in graph.nodes:
        if n.op == "get_attr" and str(n.target).rpartition(".")[2] == "training":
            path = str(n.target).rpartition(".")[0]
            reads[path] = (
                reads.get(path, True)
                and path not in called
                and bool(n.users)
                and all(_sdpa_dropout(u) or _dropout_call(u, n) for u in n.users)
            )
    return [module.get_submodule(p) for p, only_dropout in reads.items() if only_dropout]


DROPOUT_CALLS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"}


def _sdpa_dropout(u: fx.Node) -> bool:
    """`training * p` read only as a dropout probability: scaled_dot_product_attention's dropout_p, or the p of a
    dropout call (Hugging Face's eager GPT-2 attention: F.dropout(weights, p=training * attn_pdrop, ...))."""
    return (
        u.op == "call_function"
        and getattr(u.target, "__name__", "") == "mul"
        and all(
            (getattr(v.target, "__name__", "") == "scaled_dot_product_attention" and v.args[4:5] == (u,))
            or (
                getattr(v.target, "__name__", "") in DROPOUT_CALLS
                and (v.args[1:2] == (u,) or v.kwargs.get("p") is u)
                and v.args[:1] != (u,)
            )
            for v in u.users
        )
    )


def _dropout_call(u: fx.Node, flag: fx.Node) -> bool:
    """F.dropout(x, p, training=self.training) of a layer fx traced through (timm's classifier dropout)."""
    return (
        u.op == "call_function"
        and getattr(u.target, "__name__", "") in DROPOUT_CALLS
        and (u.kwargs.get("training") is flag or u.args[2:3] == (flag,))
        and all(a is not flag for a in list(u.args[:2]) + [v for k, v in u.kwargs.items() if k != "training"])
    )


@contextlib.contextmanager
def preserved_buffers(module: nn.Module) -> Iterator[nn.Module]:
    """Restore every buffer (running stats, counters) to its value on entry. One that is unchanged is left as it is:
    a buffer whose elements share memory (a constant fx folded from `index.expand(heads, -1)`) cannot be written. A
    meta buffer (a model planned without its weights) holds no values to compare: it is written back as before."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield module
    finally:
        with torch.no_grad():
            for b, v in saved:
                if b.is_meta or not torch.equal(b, v):
                    b.copy_(v)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed the global RNG (dropout draws from it) without disturbing the caller's."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        # the generators fork_rng restores, not torch.manual_seed: with CUDA not initialised that queues a seeding
        # (and formats a stack trace, ~1 ms) which would fire at CUDA's first use, long after this block
        torch.random.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed(seed)
        yield


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """TF32 off for conv and matmul (exact-ish fp32 for comparisons), restored after."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def module_device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")


def module_dtype(module: nn.Module) -> torch.dtype:
    for t in module.parameters():
        if t.is_floating_point():
            return t.dtype
    return torch.float32
