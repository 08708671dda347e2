"""Read model files safely (architecture.md §7): files written by torch.save, graphgrow's own files, and models
built from names.

A model file is untrusted input: it is read with torch.load(weights_only=True) and
only torch.nn's own layer classes allow-listed, so loading runs no code from the
file. Custom classes need `trust=True` (CLI: --trust). A model can also be named as
`package.module:factory`, which imports installed code, not code from a file.
graphgrow's own outputs (see serialize.py) load again without trust. What a name may call: factory.py;
writing: save.py.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from ..core.allocation import AllocationGuard
from ..core.errors import LoadError, first_line
from ..core.user_code import calling
from ..graph.fx_edit import finish
from ..graph.graph_meta import input_spec_of
from ..graph.inline import inline_containers
from ..graph.layers import FORMER_NAMES
from . import part_file, serialize
from .factory import cwd_importable, import_object, is_factory_name, refuse_before_import
from .hf_folder import is_hf_folder, load_folder
from .mode_switch import check_node_total


@dataclass
class LoadedModel:
    module: nn.Module
    source: str
    kind: str  # "file", "graphgrow" (a graphgrow output), "factory" or "hf-folder" (a save_pretrained folder)
    input_shape: Any = None  # the example input the source gives: a bare shape (list) or an input spec (graph.inputs)
    log: list[Any] = field(default_factory=list)
    factory_seed: int | None = None  # the seed a factory's random weights were drawn with
    stored_dtype: torch.dtype | None = None  # a Hugging Face folder's weights' dtype (a half one loads in it)
    use_cache: bool | None = None  # a Hugging Face folder's own use_cache (it loads with the cache off)
    model_name: str | None = None  # a part file's (part_file.py): the name its whole model was rebuilt by


def standard_layer_classes() -> list[type]:
    """Every nn.Module subclass defined inside torch.nn.modules, nn.Module itself, and graphgrow's own layers
    (AverageMerge, ModeSwitch)."""
    from ..graph.layers import GRAPHGROW_LAYERS
    from .mode_switch import ModeSwitch  # holds graphs as records: io's layer, beside the checks that rebuild them

    classes = {nn.Module, *GRAPHGROW_LAYERS, ModeSwitch}
    for name, mod in list(sys.modules.items()):
        if name.startswith("torch.nn.modules.") and mod is not None:
            for obj in vars(mod).values():
                if (
                    isinstance(obj, type)
                    and issubclass(obj, nn.Module)
                    and obj.__module__.startswith("torch.nn.modules.")
                ):
                    classes.add(obj)
    return sorted(classes, key=lambda c: (c.__module__, c.__name__))


def custom_classes(model: nn.Module) -> list[str]:
    """The submodule classes a safe load refuses (not torch.nn's own layers nor graphgrow's): a saved
    model holding one needs --trust to be read back."""
    allowed = set(standard_layer_classes())
    found = {
        f"{type(m).__module__}.{type(m).__qualname__}"
        for m in model.modules()
        if type(m) not in allowed and not isinstance(m, fx.GraphModule)
    }
    return sorted(found)


def _is_graphgrow_file(path: Path) -> bool:
    """A cheap look at the pickle inside a torch.save zip (nothing is unpickled): does it hold graphgrow's format
    tag?"""
    try:
        with zipfile.ZipFile(path) as z:
            member = next((m for m in z.namelist() if m.endswith("data.pkl")), None)
            return member is not None and serialize.FORMAT.encode() in z.open(member).read(1 << 16)
    except (OSError, zipfile.BadZipFile, RuntimeError):
        return False


FACTORY_SEED = 0  # factories build random weights: seeded, so a factory name means the same weights every time


def load_model(
    source: str | os.PathLike[str],
    trust: bool = False,
    factory_seed: int = FACTORY_SEED,
    max_load: int | None = None,
    weights: str | None = None,
    factory: str | None = None,
) -> LoadedModel:
    """Load a model from a file or a `package.module:factory` name (built with the global RNG seeded
    with `factory_seed`, restored afterwards). `max_load` (--max-load; None: DEFAULT_MAX_LOAD) bounds what a
    file may unpack to and what a factory may allocate, before it happens. `weights` (--weights): a safetensors
    state dict loaded strictly into a model built by name (io.weights). `factory`: the name a part file
    (part_file.py) may rebuild its model by when that is not a zoo name (the user names it again). Raises LoadError."""
    text = str(source)
    limit = DEFAULT_MAX_LOAD if max_load is None else max_load
    is_name = is_factory_name(text)
    if weights is not None:
        from .weights import refuse_weights_for

        refuse_weights_for(text, weights, is_name)  # before anything is built or read
    if is_name:
        loaded = _from_factory(text, factory_seed, limit)
        if weights is not None:
            from .weights import load_weights

            load_weights(loaded.module, weights, limit, text)
            loaded.factory_seed = None  # no value comes from the seed now: an export records no seed to rebuild it
        return loaded
    path = Path(text)
    if not path.exists():
        hint = (
            "check the path"
            if ":" not in text
            else "name a factory as package.module:function, e.g. torchvision.models:resnet18"
        )
        raise LoadError(f"no such file: {text}", hint)
    if path.is_dir():
        if is_hf_folder(path):
            return _from_hf_folder(path, text, limit)
        raise LoadError(
            f"{text} is a directory, not a model file (nor a Hugging Face folder: it has no config.json)",
            "pass the .pt file inside it, or a folder save_pretrained wrote",
        )
    if path.stat().st_size == 0:
        raise LoadError(f"{text} is empty", "the file was not written completely; save the model again")
    from .outputs import protect

    protect(path)  # no output of this run replaces it, under any name
    obj = _torch_load(path, trust, limit)
    if part_file.is_part_payload(obj):  # a model grown inside a part: rebuilt by its name, the part put back
        return _from_part_file(obj, text, trust, limit, factory)
    return _interpret(obj, text, trust)


def _from_part_file(obj: dict[str, Any], text: str, trust: bool, limit: int, factory: str | None) -> LoadedModel:
    def build(name: str, seed: int) -> nn.Module:
        return _from_factory(name, seed, limit).module

    model, name, spec, log = part_file.read(obj, text, trust, build, factory, limit)
    return LoadedModel(model, text, "graphgrow-part", spec, log, model_name=name)


def _from_hf_folder(path: Path, text: str, limit: int) -> LoadedModel:
    from .hf_zoo import default_spec
    from .outputs import protect

    for f in [path, *path.iterdir()]:
        protect(f)  # no output of this run replaces the folder or a file in it
    model, stored, use_cache = load_folder(path, limit)
    return LoadedModel(
        model,
        text,
        "hf-folder",
        input_shape=default_spec(model.config, type(model), text),
        stored_dtype=stored,
        use_cache=use_cache,
    )


def _from_factory(text: str, seed: int, limit: int) -> LoadedModel:
    from .zoo import builder, parse_name, sealed_caches, zoo_input_shape

    name = parse_name(text)
    if name.zoo is None:
        refuse_before_import(name.target)  # os:system says "standard library" before its arguments are read
    build, shape = builder(name, import_object)
    size = _size_on_meta(build)
    if size is not None and size[0] > limit:
        raise LoadError(
            f"{text[:200]} would hold {_mib(size[0])} of parameters and buffers ({size[1]:,} parameters; limit "
            f"{_mib(limit)}); nothing was allocated",
            "check the arguments, or raise the limit with --max-load SIZE",
        )
    hint = (
        "check the arguments"
        if name.kwargs
        else "the factory must build a model with no arguments (or give them: factory(key=value))"
    )
    call = text[:200] if name.kwargs else f"{text[:200]}()"
    # the real build runs under an allocation guard too: a factory the meta device cannot build, or one that builds
    # something else there (it caught the meta device's error), is held to --max-load as it allocates
    guard = AllocationGuard(limit)
    # the user's code: prints to stderr (--json stays parseable), anything raised — sys.exit too — one LoadError;
    # no cache of stored weights is in reach
    try:
        with calling(call, hint, LoadError), torch.random.fork_rng(devices=[]), cwd_importable(), sealed_caches():
            torch.manual_seed(seed)
            with guard:
                model = build()
    except BaseException as e:  # the guard's refusal passes calling() as graphgrow's own
        _refuse_over_load(text, guard, e, limit)
        raise
    _refuse_over_load(text, guard, None, limit)  # the factory may have caught the refusal and gone on
    if not isinstance(model, nn.Module):
        raise LoadError(
            f"{text[:200]}{'' if name.kwargs else '()'} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return LoadedModel(model, text, "factory", input_shape=shape or zoo_input_shape(model), factory_seed=seed)


def _refuse_over_load(text: str, guard: AllocationGuard, error: BaseException | None, limit: int) -> None:
    refusal = guard.refusal
    if refusal is not None:
        raise LoadError(
            f"{text[:200]} would hold more than {_mib(limit)} while it is built (it asked for "
            f"{_mib(getattr(refusal, 'needed', 0))} more with {_mib(getattr(refusal, 'held', 0))} held; "
            "the build was stopped before that allocation)",
            "check the arguments, or raise the limit with --max-load SIZE",
        ) from error or refusal


class _NotOnMeta(LoadError):
    """The factory failed on the meta device (whatever it raised)."""


def _size_on_meta(build: Callable[[], Any]) -> tuple[int, int] | None:
    """(bytes of parameters and buffers, parameters) of the factory's model, built on the meta device (shapes,
    no storage), so an argument like num_classes=10**8 is refused before memory is touched. None when the
    factory cannot build on meta (it computes with real tensors): then only the real build's allocation guard holds
    the limit."""
    from .zoo import sealed_caches

    try:  # graphgrow's own refusal (a download asked for) passes: building again would only ask again
        with (
            calling("the factory", None, _NotOnMeta),
            torch.device("meta"),
            torch.random.fork_rng(devices=[]),
            cwd_importable(),
            sealed_caches(),
        ):
            model = build()
    except _NotOnMeta:
        return None  # the real build reports the factory's own error (sys.exit included)
    if not isinstance(model, nn.Module):
        return None
    return (
        sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]),
        sum(p.numel() for p in model.parameters()),
    )


def _torch_load(path: Path, trust: bool, limit: int) -> Any:
    name = str(path)
    head = path.open("rb").read(8)
    if path.suffix == ".onnx":
        raise LoadError(
            f"{name} is an ONNX file", "graphgrow mutates PyTorch models: pass the .pt model it was exported from"
        )
    _check_zip(path, limit)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if trust:
                return torch.load(path, map_location="cpu", weights_only=False)
            with torch.serialization.safe_globals([*standard_layer_classes(), *FORMER_NAMES]):
                return torch.load(path, map_location="cpu", weights_only=True)
    except LoadError:
        raise
    except Exception as e:
        raise _explain(name, head, e, trust, _is_graphgrow_file(path)) from e


DEFAULT_MAX_LOAD = int(os.environ.get("GRAPHGROW_MAX_LOAD_BYTES", 16 << 30))  # what a model file may unpack to
MAX_INFLATION = 50  # a compressed member may not grow more than this; torch.save stores tensors uncompressed


def _check_zip(path: Path, limit: int) -> None:
    """Integrity and size of a torch zip file before torch.load reads it: torch.load does not check
    CRCs (corrupted tensor bytes load silently as wrong weights) and would inflate any member."""
    if not zipfile.is_zipfile(path):
        return
    name = str(path)
    try:
        with zipfile.ZipFile(path) as z:
            members = z.infolist()
            total = sum(m.file_size for m in members)
            if total > limit:
                raise LoadError(
                    f"{name} would unpack to {_mib(total)} (limit {_mib(limit)})",
                    "raise the limit with --max-load SIZE (or GRAPHGROW_MAX_LOAD_BYTES) "
                    "if the model really is that large",
                )
            for m in members:
                if m.compress_type != zipfile.ZIP_STORED and m.file_size > MAX_INFLATION * m.compress_size + (1 << 20):
                    raise LoadError(
                        f"{name}: member {m.filename[:80]} inflates {m.compress_size:,} bytes into "
                        f"{m.file_size:,}; refused (a decompression bomb?)",
                        "save the model again with torch.save",
                    )
            bad = _first_bad_member(z)
    except LoadError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as e:
        raise LoadError(
            f"{name} is a truncated or corrupted model file ({first_line(str(e), 200)})", "save the model again"
        ) from e
    if bad is not None:
        raise LoadError(
            f"{name} is corrupted: the bytes of {bad[:80]} do not match their checksum (CRC)",
            "the file was damaged after it was written; save the model again",
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _first_bad_member(z: zipfile.ZipFile) -> str | None:
    """Read every member in chunks (bounded memory; reading checks the CRC); the first that fails, or None."""
    for m in z.infolist():
        read = 0
        try:
            with z.open(m) as f:
                while chunk := f.read(1 << 22):
                    read += len(chunk)
                    if read > m.file_size:  # declared sizes can lie: never read past them
                        return m.filename
        except zipfile.BadZipFile:
            return m.filename
    return None


def _explain(name: str, head: bytes, e: Exception, trust: bool, graphgrow_file: bool = False) -> LoadError:
    msg = str(e)
    blocked = re.search(r"GLOBAL ([\w.]+)", msg)
    if blocked and not trust:
        what = blocked.group(1)
        module = what.rpartition(".")[0]
        if _module_lacks(what):
            return LoadError(f"{name} is corrupted: it names {what}, which does not exist", "save the model again")
        if module.split(".")[0] in {
            "os",
            "posix",
            "nt",
            "subprocess",
            "builtins",
            "sys",
            "shutil",
            "socket",
            "runpy",
            "importlib",
        }:
            return LoadError(
                f"{name} asks to call {what} while loading; refused, nothing was run",
                "this file is not a plain model; use --trust only if you wrote it yourself",
            )
        if graphgrow_file:  # graphgrow kept a module of an installed package whole (a leaf it does not trace through)
            return LoadError(
                f"{name} contains the custom class {what}; loading it would run that class's code",
                "pass --trust if you wrote the file yourself; graphgrow keeps such modules whole, "
                "so reading them needs trust",
            )
        return LoadError(
            f"{name} contains the custom class {what}; loading it would run that class's code",
            "pass --trust if you trust the file, or name the model by its factory, e.g. package.module:function",
        )
    if all(32 <= c < 127 or c in (9, 10, 13) for c in head):
        return LoadError(f"{name} is a text file, not a PyTorch model file", "pass a file written by torch.save")
    if "Unsupported operand" in msg and not trust:
        return LoadError(
            f"{name} is a raw pickle, not a torch.save file; refused without --trust (pickles can run code)",
            "re-save it with torch.save(model, path), or pass --trust if you wrote it yourself",
        )
    if head.startswith(b"PK"):
        return LoadError(
            f"{name} is a truncated or corrupted model file ({first_line(msg, 200)})", "save the model again"
        )
    if isinstance(e, (EOFError,)) or head[:1] == b"\x80":
        return LoadError(f"{name} is a truncated or corrupted pickle", "save the model again")
    return LoadError(
        f"{name} is not a PyTorch model file ({first_line(msg, 200) or type(e).__name__})",
        "pass a file written by torch.save",
    )


def _module_lacks(qualname: str) -> bool:
    """True when `module` is loaded here but has no `attr`: a name mangled by corruption.

    Nothing is imported (so nothing named by the file runs); a module that is not
    loaded is taken as a custom class's home.
    """
    module, _, attr = qualname.rpartition(".")
    return module in sys.modules and not hasattr(sys.modules[module], attr)


def _inline_added(gm: fx.GraphModule, log: list[Any]) -> None:
    """A file written before passes inlined their blocks holds each branch or deepen block as one call of a
    container, which the analyses cannot read: the modules its log says graphgrow added are looked through now, as
    a pass does when it inserts them (graph.inline; same module tree, same function)."""
    added = [m for entry in log for m in entry.get("modules_added", []) if isinstance(m, str)]
    if added and inline_containers(gm, added):
        finish(gm)


def _interpret(obj: Any, name: str, trust: bool) -> LoadedModel:
    if isinstance(obj, dict) and obj.get("format") == serialize.FORMAT:
        root, nodes = obj.get("root"), obj.get("nodes")
        if isinstance(root, nn.Module) and isinstance(nodes, list):  # the whole file's nodes, before any is built
            check_node_total(root, len(nodes), serialize.MAX_NODES)
        gm = serialize.from_payload(obj, trusted=trust)
        info = gm.meta["graphgrow"]
        _inline_added(gm, info.get("log", []))
        spec = input_spec_of(gm) if info.get("inputs") or info.get("input_shape") else None  # either key: older files
        return LoadedModel(gm, name, "graphgrow", spec, list(info.get("log", [])))
    if isinstance(obj, nn.Module):
        _check_module_names(obj, name)
        check_node_total(obj, 0, serialize.MAX_NODES)  # mode switches in a pickled tree: their bodies are graphs too
        return LoadedModel(obj, name, "file")
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise LoadError(
            f"{name} holds only weights (a state_dict of {len(obj)} tensors), no architecture",
            "save the whole model with torch.save(model, path), or name its factory as package.module:function",
        )
    raise LoadError(
        f"{name} holds a {type(obj).__name__}, not a model", "save the model itself with torch.save(model, path)"
    )


def _check_module_names(model: nn.Module, name: str) -> None:
    """Module, parameter and buffer names of a pickled tree are data (tracing writes them into code through
    generated identifiers, core/codegen.py): only names PyTorch itself would not register are refused."""
    from ..core.names import bad_name_in_tree

    problem = bad_name_in_tree(model)
    if problem is not None:
        raise LoadError(
            f"{name}: the {problem}; nothing was run",
            "rename it in the model, or name the model by its factory, package.module:function",
        )
