"""The exporter's ONNX optimizer (onnxscript), adjusted for the duration of one export: without its quadratic
multi-output rewrites, with the constants its rewrites add named apart from the graph's, and with constant folding
that declines where one of its rules fails. None changes what the exported graph computes: a rewrite or a fold not
done leaves the node as the exporter wrote it, for onnxruntime to run. All are restored after the export."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def tuned_optimizer() -> Iterator[None]:
    with _linear_rewrites(), _new_constants_named_apart(), _folding_declines_on_error():
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
def _new_constants_named_apart() -> Iterator[None]:
    """Each rewrite rule the optimizer will run (_naming_apart), wrapped for the export, restored after."""
    try:
        from onnxscript import rewriter

        named = [r for r in rewriter._DEFAULT_REWRITE_RULES if callable(getattr(r, "try_rewrite", None))]
    except (ImportError, AttributeError):
        yield
        return
    for r in named:
        vars(r)["try_rewrite"] = _naming_apart(r.try_rewrite)  # an instance attribute over the class's method
    try:
        yield
    finally:
        for r in named:
            vars(r).pop("try_rewrite", None)


_FRESH = itertools.count()


def _naming_apart(try_rewrite: Any) -> Any:
    """A rewrite whose new constants are renamed where the graph already holds an initializer of that name. The
    min/max-to-Clip and clip-fusion rules name a bound after the clipped tensor (`{x}_min`): a tensor clipped twice
    (Gemma 4's vision encoder clamps one input before each of q, k and v) gave two constants one name, onnxscript 0.7
    kept the first and the second clip read a value nothing makes, and the ONNX checker refused the model ("Nodes in
    a graph must be topologically sorted, however input 'mul_121_min_1' ..."). The nodes hold the value itself, so a
    new name changes nothing else."""

    @functools.wraps(try_rewrite)
    def renamed(model: Any, graph: Any, *args: Any, **kwargs: Any) -> Any:
        delta = try_rewrite(model, graph, *args, **kwargs)
        taken = getattr(graph, "initializers", None)  # a function has none: onnxscript adds nothing there
        new = (getattr(delta, "new_initializers", None) or ()) if taken is not None else ()
        for value in new:
            while value.name in taken:
                value.name = f"{value.name}_gg{next(_FRESH)}"
        return delta

    return renamed


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
