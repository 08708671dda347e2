"""`graphgrow search` from the command line: open the model, resolve the user's functions, run
the search, write the best model (and the plot), and report what was found."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..analysis.budget import parse_size
from ..core.errors import SearchError
from ..io.factory import import_object
from ..io.save import check_output_path
from ..jobs.options import LoadOptions
from ..jobs.workflow import open_model
from .space import MutationSpace


def _require_ray() -> None:
    try:
        import ray.tune  # noqa: F401
    except ImportError as e:
        raise SearchError(
            f"graphgrow search runs on Ray Tune, which is not installed here ({e})",
            "pip install 'graphgrow[search]' (or: pip install 'ray[tune]')",
        ) from e


def _check_outputs(output: str | None, plot: str | None) -> None:
    """Where the best model and the plot go, checked before a search of hours rather than after it."""
    if output:
        check_output_path(Path(output).expanduser())
    if plot:
        from .plot import plot_format

        plot_format(check_output_path(plot))


def run(
    source: str,
    *,
    train: str,
    evaluate: str,
    mutations: str,
    options,
    load: LoadOptions,
    max_params: str | None = None,
    plot: str | None = None,
    say: Callable[[str], None] = print,
    progress: Callable[[str], None] = lambda _: None,
    policy: str = "uniform",
    data: str | None = None,
) -> dict:
    """Everything `graphgrow search` does; returns the report (SearchResult.to_json() + plot path).
    `load`: how the model is opened (its memory limit is `options.limits`'); `policy`: how a move's place is
    picked (space.POLICIES); `data`: package.module:function giving (inputs, loss_fn), read by the gain policies
    and the moves with init=gradmax."""
    options.check()  # names and numbers first: nothing starts, nothing is written for a bad one
    _check_outputs(options.output, plot)
    budget = parse_size(max_params, "--max-params") if max_params is not None else None
    space = MutationSpace.parse(mutations, max_params=budget, policy=policy, data=data)
    _require_ray()
    from .runner import search

    train_fn, eval_fn = (
        import_object(train, role="training function"),
        import_object(evaluate, role="evaluation function"),
    )
    if options.resume:
        model = None  # the search's own copy of the original is used (STORAGE/NAME/original.pt)
    else:
        opened = open_model(
            source,
            input_shape=load.input_shape,
            trust=load.trust,
            leaves=load.leaves,
            progress=progress,
            trace_mode=load.trace_mode,
            max_memory=options.limits.max_memory,
            capture=load.capture,
            max_load=load.max_load,
            weights=load.weights,
        )
        model = opened.gm
    progress("searching")
    result = search(model, train_fn, eval_fn, space, options, say)
    report = result.to_json()
    if plot:
        from .plot import plot_population

        report["plot"] = str(plot_population(result.history, options.metric, plot))
    return report
