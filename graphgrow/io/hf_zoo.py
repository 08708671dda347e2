"""Hugging Face names: `hf:MODEL_TYPE[/TASK](config arguments)`, e.g. `hf:gpt2(n_layer=2,n_embd=64,n_head=4)`,
`hf:bert/sequence-classification(hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64)`.

The model is built as transformers' own code builds a fresh one: `AutoConfig.for_model(MODEL_TYPE, **arguments)`,
then the task's Auto class (TASKS; no task: `AutoModel`, the bare backbone) `.from_config(config)`. Random weights,
nothing downloaded: never `from_pretrained`, never remote code, never the hub (HF_HUB_OFFLINE and empty caches while
building, `zoo.sealed_caches`). Arguments are the config's own fields, checked by name (a typo is refused, not
ignored); `use_cache` defaults to False, since torch.export cannot capture a DynamicCache output. The loader sizes
the model on the meta device before allocating it (load.py, `--max-load`): transformers' default configs are large.
A build that fails says whose failure it is: an optional package the model's code needs and this environment lacks,
or transformers' own (the model type's default config fails alike), not the arguments.

The default input spec (`default_spec`, reported as LoadedModel.input_shape) holds only the inputs the forward
needs — no attention_mask (all positions attend, as with a mask of ones): token ids `input_ids` int64[1,16] below
`vocab_size`; images `pixel_values` float32[1,num_channels,image_size,image_size] (224 when the config has no
size; a two-tower config's vision_config gives them); audio `input_values` float32[1,16000]; encoder-decoders add
`decoder_input_ids` int64[1,16]. Token ids end with the end-of-sequence id where the forward reads it (`_eos_read`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import re
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from ..core.errors import InputError, LoadError
from ..graph.inputs import InputSpec, parse_spec

# task → transformers' Auto class; the bare model (no head) when a name gives no task
TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "image-classification": "AutoModelForImageClassification",
    "audio-classification": "AutoModelForAudioClassification",
    "ctc": "AutoModelForCTC",
}
BASE = "AutoModel"
SEQ_LEN = 16  # token ids of the default spec (fewer when the model has fewer positions)
IMAGE_SIZE = 224  # when the config has no image_size (ResNet, RegNet)
AUDIO_SAMPLES = 16_000  # one second at 16 kHz
ATTENTION = ("eager", "sdpa")  # the attention implementations a name may pick: torch's own code only
# arguments that reach code or files beyond the config: refused whatever their value
_REFUSED = {
    "trust_remote_code": "remote code is never run",
    "auto_map": "remote code is never run",
    "revision": "nothing is downloaded",
    "code_revision": "nothing is downloaded",
    "token": "nothing is downloaded",
}
_MODEL_TYPE = re.compile(r"^[A-Za-z][\w.\-]*$")  # kosmos-2.5, xlm-roberta


def split_target(target: str) -> tuple[str, str | None]:
    """`hf:llama/causal-lm` → ("llama", "causal-lm"); `hf:gpt2` → ("gpt2", None)."""
    model_type, _, task = target.split(":", 1)[1].partition("/")
    if not _MODEL_TYPE.match(model_type):
        raise LoadError(
            f"{target!r}: {model_type[:40]!r} is not a model type",
            "write hf:MODEL_TYPE[/TASK], e.g. hf:gpt2 or hf:llama/causal-lm",
        )
    if task and task not in TASKS:
        raise LoadError(f"{target}: unknown task {task[:40]!r}", f"tasks: {', '.join(TASKS)} (or none: the bare model)")
    return model_type, task or None


def builder(
    target: str, kwargs: Mapping[str, Any], sealed: Callable[[], AbstractContextManager[Any]]
) -> tuple[Callable[[], Any], InputSpec | None]:
    """A function building the model `target(**kwargs)` names (random weights, a fresh copy of the config each
    call, so a build on the meta device and the real one see the same config) and its default input spec.
    `sealed`: zoo.sealed_caches (passed in: zoo imports this module)."""
    model_type, task = split_target(target)
    _refuse_arguments(target, kwargs)
    _check_sizes(target, kwargs)
    transformers = _import_transformers()  # imported outside sealed(): hub settings are read at import
    auto = getattr(transformers, TASKS[task] if task else BASE)
    with sealed():
        config = _config(transformers, target, kwargs, model_type, task)
    model_class = _model_class(transformers, auto, config, target, model_type, task)
    spec = default_spec(config, model_class, target)  # sized before anything is built

    def build_hf() -> Any:  # load.py builds it inside sealed_caches, on the meta device first
        fresh = copy.deepcopy(config)
        if fresh.architectures is None:  # the Auto class chooses among several classes of a type by this field
            fresh.architectures = [model_class.__name__]
        try:
            return auto.from_config(fresh, trust_remote_code=False)
        except ImportError as e:  # transformers' requires_backends: a package the model's code needs
            raise LoadError(
                f"cannot build {target}: {model_class.__name__} needs an optional package that is not installed "
                f"({_first_line(e)})",
                "install that package to use this model type",
            ) from e
        except Exception as e:
            if _default_fails(transformers, auto, model_type, model_class, e):
                raise LoadError(
                    f"cannot build {target}: transformers {transformers.__version__} cannot build {model_type} even "
                    f"from its default config ({type(e).__name__}: {_first_line(e)})",
                    "not the arguments: this model type does not build with this transformers version",
                ) from e
            raise

    return build_hf, spec


def _first_line(e: BaseException) -> str:
    line = next((line for line in str(e).splitlines() if line.strip()), "")  # transformers' start with a newline
    return " ".join(line.split())[:200]


def _default_fails(transformers: Any, auto: Any, model_type: str, model_class: type, error: Exception) -> bool:
    """Whether the model type's own default config fails to build as the arguments' did (same exception type and
    message), on the meta device: then the failure is transformers', not the arguments'."""
    import torch

    try:
        default = transformers.AutoConfig.for_model(model_type)
        default.architectures = [model_class.__name__]
        with torch.device("meta"):
            auto.from_config(default, trust_remote_code=False)
    except Exception as e:
        return type(e) is type(error) and str(e) == str(error)
    return False


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise LoadError(
            f"hf: names need transformers, which is not installed ({e})", "pip install graphgrow[hf]"
        ) from e
    return transformers


def _refuse_arguments(target: str, kwargs: Mapping[str, Any]) -> None:
    for key, value in kwargs.items():
        if key in _REFUSED:
            raise LoadError(
                f"{target}: {key} is refused: {_REFUSED[key]} (a name builds random weights from a config)",
                f"drop {key}",
            )
        if key.startswith("_"):
            raise LoadError(f"{target}: {key} is a private field of the config, not an argument", f"drop {key}")
        if key == "attn_implementation" and value not in ATTENTION:
            raise LoadError(
                f"{target}: attn_implementation={value!r} is not one graphgrow builds with",
                f"one of {', '.join(ATTENTION)}",
            )


def _config(
    transformers: Any, target: str, arguments: Mapping[str, Any], model_type: str, task: str | None = None
) -> Any:
    mapping = transformers.CONFIG_MAPPING
    if model_type not in mapping:
        close = difflib.get_close_matches(model_type, list(mapping.keys()), n=5, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else "e.g. gpt2, llama, bert, t5, vit, resnet, convnext"
        raise LoadError(
            f"transformers has no model type {model_type!r} "
            f"({len(list(mapping.keys()))} types: transformers.CONFIG_MAPPING)",
            hint,
        )
    config_class = mapping[model_type]
    known = _config_fields(config_class)
    for key in arguments:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"see {config_class.__name__}'s fields"
            raise LoadError(f"{target}: {config_class.__name__} has no field {key!r}", hint)
    kwargs = dict(arguments)
    if "use_cache" in known:
        kwargs.setdefault("use_cache", False)  # a DynamicCache output cannot be captured by torch.export
    if task == "causal-lm" and "is_decoder" in known:
        # an encoder family's causal-LM head (BERT's, RoBERTa's, Reformer's) is a decoder only with this flag: without
        # it the model attends both ways (transformers warns) or refuses to build (Reformer)
        kwargs.setdefault("is_decoder", True)
    # mixture-of-experts layers computed with torch's own operators (bmm over the routed experts): the default,
    # grouped_mm, falls back on CPU to a custom operator transformers registers at import (opaque to the capture,
    # unknown to a process that has not imported it, so a graphgrow file could not hold it)
    kwargs["experts_implementation"] = "batched_mm"
    try:
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
    except Exception as e:  # the config's own validation: a size that does not divide, a bad option
        raise LoadError(
            f"{target}: the config refused the arguments: {type(e).__name__}: {str(e)[:300]}", "check the arguments"
        ) from e
    _sub_caches_off(config, arguments)
    return config


def _sub_caches_off(config: Any, arguments: Mapping[str, Any]) -> None:
    """The cache off in the sub-configs too, unless the arguments set it there: a vision-language model's text
    config has its own use_cache, which its language model reads (Qwen 3.5's; with 2 layers of linear attention
    only, its cache cannot even be read: `get_seq_length` raises, so the model could not run as built)."""
    for key in getattr(config, "sub_configs", None) or {}:
        sub, given = getattr(config, key, None), arguments.get(key)
        if getattr(sub, "use_cache", None) and not (isinstance(given, Mapping) and "use_cache" in given):
            sub.use_cache = False


def _config_fields(config_class: type) -> set[str]:
    """The names a config takes: its fields, their aliases (attribute_map: GPT-2's hidden_size is n_embd) and
    settable properties such as num_labels."""
    fields = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    props = {
        k
        for k in dir(config_class)
        if isinstance(getattr(config_class, k, None), property) and getattr(config_class, k).fset
    }
    return {
        k
        for k in fields | props | set(getattr(config_class, "attribute_map", {})) | {"attn_implementation"}
        if not k.startswith("_")
    }


def _model_class(transformers: Any, auto: Any, config: Any, target: str, model_type: str, task: str | None) -> type:
    mapping = auto._model_mapping
    if type(config) not in mapping:
        tasks = [t for t, cls in TASKS.items() if type(config) in getattr(transformers, cls)._model_mapping]
        raise LoadError(
            f"{target}: transformers has no {task or 'bare'} model for {model_type}",
            f"its tasks: {', '.join(tasks)}"
            if tasks
            else "this model type has no model graphgrow can build from a name",
        )
    found = mapping[type(config)]
    # several classes for one type (DeiT and LeViT with and without a distillation head, Perceiver's three
    # preprocessors, Funnel's full and base models): the first, the one transformers lists as the task's own
    model_class: type = found[0] if isinstance(found, (tuple, list)) else found
    return model_class


def default_spec(config: Any, model_class: type, target: str = "the model") -> InputSpec | None:
    """The inputs the model's forward needs, from its config (module docstring); None for an input kind not
    known here (then give --input). Sized and checked here, before the model or any input is built: a setting
    that is not a positive size, or a default input past the example bound (graph.inputs), is a LoadError
    naming the setting."""
    main = getattr(model_class, "main_input_name", "input_ids")
    if main not in ("input_ids", "pixel_values", "input_values") and _takes(model_class, "input_ids"):
        main = "input_ids"  # a main input of another name that also takes token ids (Perceiver's `inputs`)
    if main == "input_ids":
        records, settings = [_token_ids("input_ids", config, target, _eos_read(config, model_class))], "vocab_size"
    elif main == "pixel_values":
        # a model of two towers (CLIP, SigLIP) sizes its images in its vision config
        vision = config if hasattr(config, "image_size") else getattr(config, "vision_config", None) or config
        size = _pair(getattr(vision, "image_size", IMAGE_SIZE), target)
        channels = _positive(getattr(vision, "num_channels", 3), "num_channels", target)
        records, settings = [{"name": "pixel_values", "shape": [1, channels, *size]}], "image_size and num_channels"
    elif main == "input_values":
        records, settings = [{"name": "input_values", "shape": [1, AUDIO_SAMPLES]}], "the audio input"
    else:
        return None
    if getattr(config, "is_encoder_decoder", False):
        records.append(_token_ids("decoder_input_ids", config, target))
    try:
        return parse_spec(records)  # the bounds every example input has: per dimension and in all
    except InputError as e:
        raise LoadError(
            f"{target}: the default input its {settings} give is too large: {e.message}",
            "give smaller settings, or the input explicitly with --input",
        ) from e


def _check_sizes(target: str, kwargs: Mapping[str, Any]) -> None:
    """The settings the default input is made from, as given: checked before the config sees them (its own
    validation only warns about some, e.g. token ids past a vocabulary of 0)."""
    for setting in ("vocab_size", "num_channels"):
        if setting in kwargs:
            _positive(kwargs[setting], setting, target)
    if "image_size" in kwargs:
        _pair(kwargs["image_size"], target)


def _positive(value: Any, setting: str, target: str) -> int:
    if type(value) is not int or value <= 0:
        raise LoadError(
            f"{target}: {setting}={str(value)[:60]} is not a positive integer", f"give {setting} as a positive integer"
        )
    return value


def _token_ids(name: str, config: Any, target: str, last: int | None = None) -> dict[str, Any]:
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and callable(getattr(config, "get_text_config", None)):
        # a model of several towers (audio or vision and a language model) keeps the vocabulary in its text
        # config; its first nn.Embedding may be another tower's, larger
        vocab = getattr(config.get_text_config(), "vocab_size", None)
    positions = getattr(config, "max_position_embeddings", None)
    length = min(SEQ_LEN, positions) if isinstance(positions, int) and positions > 0 else SEQ_LEN
    high = None if vocab is None else _positive(vocab, "vocab_size", target)  # token ids are drawn below it
    record = {"name": name, "shape": [1, length], "dtype": "int64", "high": high}
    return record if last is None or (high is not None and last >= high) else {**record, "last": last}


def _takes(model_class: type, name: str) -> bool:
    """Whether the model's forward has a parameter `name`."""
    try:
        return name in inspect.signature(getattr(model_class, "forward")).parameters  # noqa: B009 - a type
    except (TypeError, ValueError):
        return False


def _eos_read(config: Any, model_class: type) -> int | None:
    """The end-of-sequence id the example token ids end with, where the model's forward reads it from its config
    (T5's and BART's classification heads pool at the eos token, and refuse an input without one), as a tokenizer's
    output ends with it; None where the forward does not read it (the ids stay random)."""
    eos = getattr(config, "eos_token_id", None)
    if type(eos) is not int or eos < 0:
        return None
    try:
        source = inspect.getsource(getattr(model_class, "forward"))  # noqa: B009 - a type, no attribute to mypy
    except (OSError, TypeError):
        return None
    return eos if "eos_token_id" in source else None


def _pair(size: Any, target: str) -> tuple[int, int]:
    if isinstance(size, (list, tuple)):
        if len(size) != 2:
            raise LoadError(
                f"{target}: image_size={str(size)[:60]} is not a size or a (height, width) pair",
                "give image_size=N or image_size=[H,W]",
            )
        return _positive(size[0], "image_size", target), _positive(size[1], "image_size", target)
    side = _positive(size, "image_size", target)
    return side, side
