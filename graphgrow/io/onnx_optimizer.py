"""The exporter's ONNX optimizer (onnxscript), adjusted for the duration of one export: without its quadratic
multi-output rewrites, and with constant folding that declines where one of its rules fails. Neither changes what
the exported graph computes: a rewrite or a fold not done leaves the node as the exporter wrote it, for onnxruntime
to run. Both are restored after the export."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def tuned_optimizer() -> Iterator[None]:
    with _linear_rewrites(), _folding_declines_on_error():
        yield


@contextlib.contextmanager
def _linear_rewrites() -> Iterator[None]:
    """The optimizer without its rewrite rules whose pattern has several output nodes (today one: two Slices of a
    tensor made a Split). Their matcher lists every node of the graph again for each node it tries, quadratic in the
    graph's size: 80 % of hf qwen3_5_moe_text's run (py-spy), whose unrolled chunked linear attention exports to
    thousands of Slices. Every other rule still runs; onnxruntime does its own fusions."""
    try:
        from onnxscript import rewriter

        rules = rewriter._DEFAULT_REWRITE_RULES
        linear = tuple(
            r
            for r in rules
            if getattr(getattr(r, "_matcher", None), "pattern", None) is None
            or r._matcher.pattern.has_single_output_node
        )
    except (ImportError, AttributeError):
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = linear
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


@contextlib.contextmanager
def _folding_declines_on_error() -> Iterator[None]:
    """Constant folding whose rules decline (return None: the node stays) where they raise. onnxscript 0.7's rule
    for SplitToSequence reads `.ndim` of a split size it does not know when the size is a scalar computed at run
    time: torch.chunk of a batch made by concatenation (torchvision's RAFT runs both frames through its encoder as
    one batch and chunks them apart) failed the whole export with "'NoneType' object has no attribute 'ndim'"."""
    try:
        from onnxscript.optimizer import _constant_folding as folding

        table = folding.registry.op_evaluators
        saved = {key: list(evaluators) for key, evaluators in table.items()}
        make = type(next(e for evaluators in table.values() for e in evaluators))
    except (ImportError, AttributeError, StopIteration):
        yield
        return
    for key, evaluators in saved.items():
        table[key] = [make(e.min_version, e.max_version, _declining(e.function)) for e in evaluators]
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


def _declining(rule: Any) -> Any:
    @functools.wraps(rule)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return rule(*args, **kwargs)
        except Exception:  # a fold not done: the node runs as exported
            return None

    return guarded
