"""Model names: `timm:NAME`, `torchvision:NAME`, `hf:MODEL_TYPE[/TASK]` (Hugging Face transformers, hf_zoo.py) and
`package.module:factory`, each optionally with literal keyword arguments — `timm:resnet26d(drop_path_rate=0.1)`,
`hf:gpt2(n_layer=2,n_embd=64,n_head=4)`, `mypkg.models:net(width=64)`.

Arguments are parsed, never evaluated: only Python literals (numbers, strings, booleans, None,
tuples, lists, dicts of them) are accepted. Zoo models get random weights (nothing is
downloaded) and their default input shape from the zoo's own metadata: timm's
`pretrained_cfg["input_size"]`, torchvision's weights' crop size, an hf: model's config. A name never asks for stored
weights (`refuse_weight_arguments`), a zoo's model spelled as an import path
(`torchvision.models:resnet18`) goes through the zoo's path, and every build runs with empty
model caches (`sealed_caches`).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import LoadError
from ..core.names import shown
from ..graph.inputs import InputSpec

ZOOS = ("timm", "torchvision", "hf")
_NAME = re.compile(r"^(?P<target>hf:[A-Za-z][\w.\-]*/[\w\-]+|[A-Za-z_][\w.]*:[A-Za-z_][\w.\-]*)(?P<args>\(.*)?$", re.S)
MAX_ARGUMENTS = 2_000  # characters of arguments: a model name is not a program


@dataclass
class ModelName:
    target: str  # "timm:resnet26d", "pkg.mod:factory"
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def zoo(self) -> str | None:
        prefix = self.target.split(":")[0]
        return prefix if prefix in ZOOS else None

    @property
    def short(self) -> str:
        """The model's own name (for default output file names)."""
        return re.sub(r"[^\w.\-]", "_", self.target.split(":")[1])


def looks_like_name(text: str) -> bool:
    return bool(_NAME.match(text.strip()))


def parse_name(text: str) -> ModelName:
    """`target` or `target(key=literal, …)` → ModelName; LoadError for anything else."""
    m = _NAME.match(text.strip())
    if not m:
        raise LoadError(
            f"{text[:80]!r} does not name a model",
            "write timm:NAME, torchvision:NAME, hf:MODEL_TYPE[/TASK] or package.module:factory",
        )
    args = m.group("args")
    if not args:
        return ModelName(m.group("target"))
    if len(args) > MAX_ARGUMENTS:
        raise LoadError(
            f"the arguments of {m.group('target')} are {len(args):,} characters long", "keep model arguments short"
        )
    if not args.rstrip().endswith(")"):
        raise LoadError(f"the arguments of {m.group('target')} are not closed", "end them with ')'")
    try:
        call = ast.parse("f" + args, mode="eval").body
    except SyntaxError as e:
        raise LoadError(
            f"cannot read the arguments of {m.group('target')}: {e.msg}", "write key=value pairs of literals"
        ) from None
    if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
        raise LoadError(
            f"the arguments of {m.group('target')} must be key=value pairs", "e.g. timm:resnet26d(num_classes=10)"
        )
    kwargs = {}
    for k in call.keywords:
        if k.arg in kwargs:  # ast accepts f(a=1, a=2); Python itself refuses it
            raise LoadError(f"argument {k.arg} of {m.group('target')} is given twice", "give each argument once")
        try:
            kwargs[str(k.arg)] = ast.literal_eval(k.value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise LoadError(
                f"argument {k.arg} of {m.group('target')} is not a literal",
                "only numbers, strings, True/False/None and lists, tuples or dicts of them; nothing is evaluated",
            ) from None
    return ModelName(m.group("target"), kwargs)


# --- arguments that ask for stored weights: refused whatever the name, before anything is imported or built ---
# Words that, anywhere in an argument's name, ask for stored weights or a file: pretrained, pretrained_cfg(_overlay),
# weights, weights_backbone, weights_only, checkpoint_path, ckpt ...
_WEIGHT_WORDS = ("pretrain", "weights", "checkpoint", "ckpt", "safetensors", "state_dict")
# Words of an argument's name (split at '_' and camelCase) that name a file, a folder, a URL or a cache.
_FILE_TOKENS = {
    "file",
    "files",
    "filename",
    "fname",
    "filepath",
    "path",
    "url",
    "uri",
    "urls",
    "hub",
    "cache",
    "dir",
    "folder",
    "download",
    "load",
    "repo",
}
# Sizes and switches that only sound like weights (found by scanning every timm and torchvision model's
# arguments): random-init switches, box-coder factors, gradient checkpointing, Swin-V2's window sizes;
# transformers' KV-cache switch.
_ORDINARY = {
    "init_weights",
    "bbox_reg_weights",
    "grad_checkpointing",
    "gradient_checkpointing",
    "use_checkpoint",
    "pretrained_window_size",
    "pretrained_window_sizes",
    "use_cache",
}
_WEIGHT_SUFFIXES = (
    ".pt",
    ".pth",
    ".bin",
    ".ckpt",
    ".safetensors",
    ".pkl",
    ".pickle",
    ".npz",
    ".npy",
    ".h5",
    ".onnx",
    ".tar",
    ".zip",
    ".json",
    ".yaml",
    ".yml",
)
_SCHEME = re.compile(r"^[A-Za-z][\w.+\-]*:")  # https:, file:, hf-hub:, s3:, C: (a drive)


def asks_for_weights(key: str) -> bool:
    """Does an argument with this name ask for stored weights or a file? (timm's drop_path_rate does not:
    there 'path' is stochastic depth's.)"""
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key).lower()
    if words in _ORDINARY:
        return False
    tokens = set(re.split(r"[^a-z0-9]+", words.replace("drop_path", "droppath")))
    return any(w in words for w in _WEIGHT_WORDS) or bool(tokens & _FILE_TOKENS)


def names_a_file(value: str) -> bool:
    """A string that is a path, a URL or a weights file's name (an existing file counts too)."""
    text = value.strip()
    if any(c in text for c in "/\\\0") or _SCHEME.match(text) or text.startswith("~") or text in (".", ".."):
        return True
    if text.lower().endswith(_WEIGHT_SUFFIXES):
        return True
    try:
        return bool(text) and os.path.lexists(text)
    except (OSError, ValueError):
        return True


def _walk(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    """(where, value) for every value nested in lists, tuples and dicts, dict keys included."""
    yield where, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(k, f"{where} key")
            yield from _walk(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{where}[{i}]")


def refuse_weight_arguments(name: ModelName) -> None:
    """A model name builds random weights only: an argument that asks for stored weights (by its name, or a
    key of a dict it holds, with a value other than None/False/empty) or a string that names a file or URL,
    anywhere in the arguments, is refused."""
    for key, value in name.kwargs.items():
        _refuse_weight_key(name.target, key, key, value)
        for where, item in _walk(value, key):
            if isinstance(item, dict):
                for k, v in item.items():
                    if isinstance(k, str):
                        _refuse_weight_key(name.target, key, f"{where}[{k!r}]", v, k)
            if isinstance(item, str) and names_a_file(item):
                raise LoadError(
                    f"{name.target}: {where}={shown(item)} names a file, folder or URL, and a model name "
                    "reads no files (random weights only)",
                    f"pass sizes and options only; {_WAY_OUT}",
                )


_WAY_OUT = (
    "for trained weights, load them in Python and grow the model there (graphgrow.trace), "
    "or torch.save it and pass the file"
)


def _refuse_weight_key(target: str, key: str, where: str, value: Any, word: str | None = None) -> None:
    if asks_for_weights(word or key) and _truthy(value):
        raise LoadError(
            f"{target}: {where}={shown(value)} asks for stored weights or a file, and a model name builds "
            "random weights only (nothing is downloaded, no checkpoint is read behind the safe loader)",
            f"drop {key}; {_WAY_OUT}",
        )


def _truthy(value: Any) -> bool:
    try:
        return bool(value)
    except Exception:  # a literal always has a truth value; fail closed anyway
        return True


# --- a zoo's registered models, however the name spells them ---


def registered_model(obj: Any) -> ModelName | None:
    """`torchvision:NAME` / `timm:NAME` when obj is that zoo's registered builder for NAME (reached through any
    module, e.g. torchvision.models.resnet:resnet18), else None. Looks only at zoos already imported."""
    home = str(getattr(obj, "__module__", None) or "").split(".")[0]
    if home == "torchvision" and "torchvision.models" in sys.modules:
        models = sys.modules["torchvision.models"]
        own = getattr(obj, "__name__", "")
        for model in ([own] if own in models.list_models() else []) + models.list_models():
            if models.get_model_builder(model) is obj:
                return ModelName(f"torchvision:{model}")
    if home == "timm" and "timm.models" in sys.modules:
        timm_models = sys.modules["timm.models"]
        own = getattr(obj, "__name__", "")
        if own and timm_models.is_model(own) and timm_models.model_entrypoint(own) is obj:
            return ModelName(f"timm:{own}")
    return None


def builder(
    name: ModelName, import_object: Callable[..., Any]
) -> tuple[Callable[[], Any], list[int] | InputSpec | None]:
    """A function building the model (random weights) and its default input shape (an input spec for hf:
    names) when the zoo knows it."""
    refuse_weight_arguments(name)  # every name, whatever its spelling, before anything is imported
    if name.zoo == "hf":
        from .hf_zoo import builder as hf_builder

        return hf_builder(name.target, name.kwargs, sealed_caches)
    if name.zoo is None:
        factory = import_object(name.target, zoo_builders=True)
        spelled = registered_model(factory)
        if spelled is None:
            return (lambda: factory(**name.kwargs)), None
        name = ModelName(spelled.target, name.kwargs)  # torchvision.models:resnet18 is torchvision:resnet18
    zoo, model = name.zoo, name.target.split(":")[1]
    if zoo == "timm":
        timm = _import(zoo)
        if not timm.is_model(model.split(".")[0]):
            close = timm.list_models(f"*{model.split('.')[0][:12]}*")[:5]
            raise LoadError(
                f"timm has no model {model!r}",
                f"did you mean {', '.join(close)}?" if close else "see timm.list_models()",
            )
        kwargs = {**name.kwargs, "pretrained": False}

        def build_timm() -> Any:
            return timm.create_model(model, **kwargs)

        return build_timm, None  # the shape is read from the built model's pretrained_cfg (zoo_input_shape)
    models = _import("torchvision.models")
    if model not in models.list_models():
        raise LoadError(f"torchvision has no model {model!r}", "see torchvision.models.list_models()")
    kwargs = {**name.kwargs, "weights": None}
    if "weights_backbone" in inspect.signature(models.get_model_builder(model)).parameters:
        kwargs["weights_backbone"] = None  # its default is ImageNet weights (detection, segmentation): random here too

    def build_torchvision() -> Any:
        return models.get_model(model, **kwargs)

    return build_torchvision, _torchvision_shape(models, model)


# --- no cache of stored weights is in reach while a named model is built ---
_CACHE_ENV = ("TORCH_HOME", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE")


@contextlib.contextmanager
def sealed_caches() -> Iterator[None]:
    """torch.hub's and Hugging Face's caches point at an empty temporary folder (offline), and torch.hub
    cannot download, while a named model is built: even a factory that asks for cached or published
    weights finds none. Everything is restored afterwards."""
    import torch.hub

    saved_env = {k: os.environ.get(k) for k in _CACHE_ENV}
    saved_hub = getattr(torch.hub, "_hub_dir", None)  # set by torch.hub.set_dir; None means "from TORCH_HOME"
    saved_download = torch.hub.download_url_to_file
    hf = sys.modules.get("huggingface_hub.constants")  # read at import: patched too when already imported
    hf_names = ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ASSETS_CACHE", "HF_XET_CACHE")
    saved_hf = {k: getattr(hf, k) for k in hf_names if hf is not None and hasattr(hf, k)}
    with tempfile.TemporaryDirectory(prefix="graphgrow-empty-cache-") as empty:
        try:
            os.environ.update(
                {
                    "TORCH_HOME": empty,
                    "HF_HOME": empty,
                    "HF_HUB_CACHE": empty,
                    "HUGGINGFACE_HUB_CACHE": empty,
                    "HF_HUB_OFFLINE": "1",
                }
            )
            torch.hub.set_dir(os.path.join(empty, "hub"))
            torch.hub.download_url_to_file = _no_download  # what load_state_dict_from_url and hub.load call
            for k in saved_hf:
                setattr(hf, k, True if k == "HF_HUB_OFFLINE" else empty)
            yield
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            torch.hub._hub_dir = saved_hub
            torch.hub.download_url_to_file = saved_download
            for k, v in saved_hf.items():
                setattr(hf, k, v)


def _no_download(url: str, *args: Any, **kwargs: Any) -> None:
    raise LoadError(
        f"the model asked to download {str(url)[:200]}; a model name builds random weights only",
        "build it without stored weights, or load trained weights in Python and pass the saved file",
    )


def zoo_input_shape(module: Any) -> list[int] | None:
    """(1, C, H, W) from a timm model's pretrained_cfg, when it has one."""
    cfg = getattr(module, "pretrained_cfg", None)
    size = cfg.get("input_size") if isinstance(cfg, dict) else None
    if isinstance(size, (tuple, list)) and all(isinstance(d, int) and d > 0 for d in size):
        return [1, *size]
    return None


def _torchvision_shape(models: Any, model: str) -> list[int] | None:
    """(1, 3, crop, crop) from the weights' own transforms (metadata only: no weights are downloaded)."""
    try:
        weights = models.get_model_weights(model).DEFAULT
        crop = weights.transforms().crop_size
        if weights.meta.get("categories") is None:
            return None
        return [1, 3, int(crop[0]), int(crop[-1])]
    except (ValueError, AttributeError, TypeError, KeyError, IndexError):
        return None


def _import(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise LoadError(f"{module.split('.')[0]} is not installed ({e})", f"pip install {module.split('.')[0]}") from e
