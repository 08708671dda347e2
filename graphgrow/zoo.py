"""Model names: `timm:NAME`, `torchvision:NAME` and `package.module:factory`, each optionally with
literal keyword arguments — `timm:resnet26d(drop_path_rate=0.1)`, `mypkg.models:net(width=64)`.

Arguments are parsed, never evaluated: only Python literals (numbers, strings, booleans, None,
tuples, lists, dicts of them) are accepted. Zoo models get random weights (nothing is
downloaded) and their default input shape from the zoo's own metadata: timm's
`pretrained_cfg["input_size"]`, torchvision's weights' crop size.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import LoadError

ZOOS = ("timm", "torchvision")
_NAME = re.compile(r"^(?P<target>[A-Za-z_][\w.]*:[A-Za-z_][\w.\-]*)(?P<args>\(.*)?$", re.S)
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
        raise LoadError(f"{text[:80]!r} does not name a model", "write timm:NAME, torchvision:NAME or package.module:factory")
    args = m.group("args")
    if not args:
        return ModelName(m.group("target"))
    if len(args) > MAX_ARGUMENTS:
        raise LoadError(f"the arguments of {m.group('target')} are {len(args):,} characters long", "keep model arguments short")
    if not args.rstrip().endswith(")"):
        raise LoadError(f"the arguments of {m.group('target')} are not closed", "end them with ')'")
    try:
        call = ast.parse("f" + args, mode="eval").body
    except SyntaxError as e:
        raise LoadError(f"cannot read the arguments of {m.group('target')}: {e.msg}", "write key=value pairs of literals") from None
    if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
        raise LoadError(f"the arguments of {m.group('target')} must be key=value pairs", "e.g. timm:resnet26d(num_classes=10)")
    kwargs = {}
    for k in call.keywords:
        if k.arg in kwargs:  # ast accepts f(a=1, a=2); Python itself refuses it
            raise LoadError(f"argument {k.arg} of {m.group('target')} is given twice", "give each argument once")
        try:
            kwargs[str(k.arg)] = ast.literal_eval(k.value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise LoadError(f"argument {k.arg} of {m.group('target')} is not a literal",
                            "only numbers, strings, True/False/None and lists, tuples or dicts of them; nothing is evaluated") from None
    return ModelName(m.group("target"), kwargs)


# Arguments that would make a zoo download weights or read a checkpoint file behind the safe loader's back.
_WEIGHT_ARGUMENTS = {"timm": ("pretrained", "checkpoint_path"),
                     "torchvision": ("weights", "weights_backbone", "pretrained", "pretrained_backbone")}


def _refuse_weight_arguments(name: ModelName) -> None:
    for k in _WEIGHT_ARGUMENTS.get(name.zoo or "", ()):
        if name.kwargs.get(k) not in (None, False, ""):
            raise LoadError(f"{name.target}: {k}={name.kwargs[k]!r} asks for stored weights, and zoo names build "
                            "random weights only (nothing is downloaded, no checkpoint is read behind the safe loader)",
                            f"drop {k}; for trained weights, load them in Python and grow the model there (graphgrow.trace), "
                            "or torch.save it and pass the file")


def builder(name: ModelName, import_object: Callable[[str], Callable]) -> tuple[Callable[[], Any], list[int] | None]:
    """A function building the model (random weights) and its default input shape when the zoo knows it."""
    zoo, model = name.zoo, name.target.split(":")[1]
    _refuse_weight_arguments(name)
    if zoo == "timm":
        timm = _import(zoo)
        if not timm.is_model(model.split(".")[0]):
            close = timm.list_models(f"*{model.split('.')[0][:12]}*")[:5]
            raise LoadError(f"timm has no model {model!r}", f"did you mean {', '.join(close)}?" if close else "see timm.list_models()")
        kwargs = {**name.kwargs, "pretrained": False}

        def build_timm():
            return timm.create_model(model, **kwargs)
        return build_timm, None  # the shape is read from the built model's pretrained_cfg (zoo_input_shape)
    if zoo == "torchvision":
        models = _import("torchvision.models")
        if model not in models.list_models():
            raise LoadError(f"torchvision has no model {model!r}", "see torchvision.models.list_models()")
        kwargs = {**name.kwargs, "weights": None}

        def build_torchvision():
            return models.get_model(model, **kwargs)
        return build_torchvision, _torchvision_shape(models, model)
    factory = import_object(name.target)
    return (lambda: factory(**name.kwargs)), None


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
