"""The flags every command shares (_common): the loading flags, gathered into one `load` argument
(jobs.options.LoadOptions), --max-load (into it, as bytes), --weights (into it), --max-memory (passed to the job,
parsed there), --json, --debug."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from ..core.errors import GraphgrowError

INPUT_SHAPE_HELP = "example input shape N,C,H,W (needed when the model file cannot tell it), e.g. 1,3,224,224"


DATA_HELP = (
    "a function of yours returning (inputs, loss_fn): a batch of model inputs and the loss of the model's output"
)


INPUT_HELP = (
    "one named model input NAME:DTYPE[SHAPE], e.g. input_ids:int64[1,seq=128]; repeat for each input the forward "
    "takes (int inputs are drawn below the model's vocabulary; *mask inputs are ones; a named size such as "
    "seq=128 stays dynamic in ONNX)"
)
WEIGHTS_HELP = (
    "trained weights for a model named timm:NAME, torchvision:NAME, hf:TYPE or package.module:factory: a "
    "safetensors state dict loaded strictly (every key, every shape) into the model built by name; never a pickle"
)
CAPTURE_HELP = (
    "how to capture the model: fx (symbolic tracing), export (torch.export: Hugging Face transformers) or "
    "auto (fx, torch.export when fx cannot trace the model or an input is not one float tensor)"
)


def _load_options(f: Callable) -> Callable:
    """The loading flags become one `load` argument (jobs.options.LoadOptions); --input values become its example
    input (an input spec), and given with --input-shape they clash."""

    @functools.wraps(f)
    def wrapper(
        *args,
        input_shape: Any,
        inputs: tuple[str, ...],
        trust: bool,
        leaves: tuple[str, ...],
        trace_mode: str,
        capture: str,
        max_load: str | None,
        weights: str | None,
        **kwargs,
    ):
        from ..jobs.options import LoadOptions

        if inputs:
            if input_shape:
                raise click.UsageError("give --input-shape (one float input) or --input (named inputs), not both")
            from ..graph.inputs import parse_spec

            try:
                input_shape = parse_spec(",".join(inputs))
            except GraphgrowError as e:
                raise click.BadParameter(str(e), param_hint="--input") from e
        load = LoadOptions(
            input_shape=input_shape,
            trust=trust,
            leaves=leaves,
            trace_mode=trace_mode,
            capture=capture,
            max_load=_load_bytes(max_load),
            weights=weights,
        )
        return f(*args, load=load, **kwargs)

    return wrapper


def _memory(max_memory: str | None) -> int:
    """--max-memory in bytes (8G when not given), parsed inside the job: a bad value is the usual one-line error."""
    from ..analysis.budget import Limits

    return Limits.parse(max_memory=max_memory).max_memory


def _common(f: Callable) -> Callable:
    f = _load_options(f)
    f = click.option("--input-shape", "input_shape", metavar="N,C,H,W", help=INPUT_SHAPE_HELP)(f)
    f = click.option("--input", "inputs", multiple=True, metavar="NAME:DTYPE[SHAPE]", help=INPUT_HELP)(f)
    f = click.option(
        "--capture", type=click.Choice(["auto", "fx", "export"]), default="auto", show_default=True, help=CAPTURE_HELP
    )(f)
    f = click.option(
        "--trust",
        is_flag=True,
        help="allow loading pickles with custom classes, and using the code names a file stores (replay's logged data "
        "function, search --resume's folder): runs code from them; only for files you trust",
    )(f)
    f = click.option(
        "--leaf",
        "leaves",
        multiple=True,
        metavar="MODULE",
        help="keep this submodule as one opaque call when tracing (repeatable; untraceable submodules, and "
        "mode-branching ones that cannot be merged, become leaves automatically)",
    )(f)
    f = click.option(
        "--trace-mode",
        "trace_mode",
        type=click.Choice(["eval", "train"]),
        default="eval",
        show_default=True,
        help="structure to trace when the model's top-level forward branches on self.training "
        "(eval: the deployed function; train: keeps auxiliary outputs)",
    )(f)
    f = click.option(
        "--max-load",
        "max_load",
        metavar="SIZE",
        help="refuse a model file that would unpack to more than this (default 16G)",
    )(f)
    f = click.option("--weights", "weights", metavar="FILE.safetensors", help=WEIGHTS_HELP)(f)
    f = click.option("--max-memory", "max_memory", metavar="SIZE", help=MAX_MEMORY_HELP)(f)
    f = click.option("--json", "as_json", is_flag=True, help="print one JSON object on stdout instead of tables")(f)
    f = click.option("--debug", is_flag=True, help="show tracebacks")(f)
    return f


MAX_MEMORY_HELP = (
    "refuse a model whose activations at the largest batch run, a pass whose allocations, new weights, "
    "verification gradients and activations, or an ONNX export or check, would need more than this beyond "
    "the model's weights, or cannot be estimated (default 8G; none: no limit)"
)


def _load_bytes(value: str | None) -> int | None:
    """--max-load in bytes (None when not given: io.load's default); a bad value is the flag's usage error (exit 2)."""
    if value is None:
        return None
    from ..analysis.budget import parse_size

    try:
        return parse_size(value, "--max-load")
    except GraphgrowError as e:
        raise click.BadParameter(e.message, param_hint="'--max-load'") from e
