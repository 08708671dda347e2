"""What a model name may call (architecture.md §7): `package.module:factory` imports installed code, so a name calls
only a model's code — an nn.Module subclass, a zoo's registered builder (routed through zoo.py), or a function
or class of the user's own code. Everything an installed library offers otherwise is refused (an allow-list).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch import nn

from ..core.errors import LoadError
from ..core.user_code import calling

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def is_factory_name(source: str) -> bool:
    """A model name (zoo:NAME, package.module:factory, optionally with literal arguments), not a file."""
    from .zoo import looks_like_name

    if not looks_like_name(source):
        return False
    try:
        return not Path(source).exists()
    except OSError:  # a name too long to be a path is not a file
        return True


# A name calls installed code only where that code is a model's: a zoo's registered builder (routed through
# the zoo, zoo.builder), an nn.Module subclass (its constructor is model code), or a function or class of the
# user's own code. Everything else an installed library offers — torch.load, click.open_file,
# timm.models.load_checkpoint, torch.hub.load — is refused: an allow-list, so a new spelling is refused too.
_NEVER_FACTORIES = {"graphgrow", "__main__"}  # graphgrow's own functions, and the running script


@contextlib.contextmanager
def cwd_importable() -> Iterator[None]:
    """The current folder on sys.path — last, so installed packages win — only while a named factory is
    imported and called: a stray .py file there is never picked up by a later import (an optional
    dependency probed lazily during tracing or export)."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


_WAY_OUT = (
    "name a zoo model (timm:NAME, torchvision:NAME), an nn.Module class, or a function of your own code: "
    "in the current folder, on PYTHONPATH or installed with pip install -e"
)
MODEL_FACTORY = "model factory"  # what a name is asked to be (import_object's `role`): each says its own way out
_YOUR_FUNCTION = (
    "name a function of your own code: in the current folder, on PYTHONPATH or installed with pip install -e"
)


def _way_out(role: str) -> str:
    return _WAY_OUT if role == MODEL_FACTORY else _YOUR_FUNCTION


def import_object(name: str, zoo_builders: bool = False, role: str = MODEL_FACTORY) -> Callable[..., Any]:
    """The callable named `package.module:function`, when a name may call it: for a model factory an nn.Module
    subclass, a function or class of the user's own code, or (with `zoo_builders`) a zoo's registered model
    builder; for any other `role` ("data function", "training function") only the user's own code.
    Installed packages come first; the current folder is searched last, so a user's own module is found
    but cannot shadow an installed one. The import runs as the user's code (core.user_code: its prints go to
    stderr, a sys.exit there is an error). Raises LoadError.

    Only names the user gave reach here: a name read from a file (a mutation log's `data`) is never imported
    unless the user trusts the file (pipeline.from_log)."""
    if not _FACTORY.match(name):
        raise LoadError(
            f"{name[:200]!r} does not name a function", "write package.module:function, e.g. mytask:train_epoch"
        )
    refuse_before_import(name, role)
    module_name, attr = name.split(":")
    try:
        with (
            cwd_importable(),
            calling(f"importing {module_name} (for {name})", "fix the module, or check the name", LoadError),
        ):
            module = importlib.import_module(module_name)
    except LoadError as e:
        if isinstance(e.__cause__, ImportError):
            raise LoadError(
                f"cannot import '{module_name}' for {name}: {e.__cause__}", "install the package or check the name"
            ) from e.__cause__
        raise
    obj: Callable[..., Any] | None = getattr(module, attr, None)
    if not callable(obj):
        raise LoadError(f"'{module_name}' has no callable '{attr}'", f"see dir({module_name}) for the names it offers")
    if role == MODEL_FACTORY and isinstance(obj, type) and issubclass(obj, nn.Module):
        return obj
    if zoo_builders:
        from .zoo import registered_model

        if registered_model(obj) is not None:
            return obj
    library = library_of(obj)
    if library is not None:
        what = getattr(obj, "__name__", None) or attr  # its own name: a re-export says what it really is
        whose = f"{what} from {library}" if " " in library else f"{library}'s own {what}"
        calls = (
            "nn.Module classes, a zoo's registered models and the user's own code"
            if role == MODEL_FACTORY
            else "the user's own code"
        )
        raise LoadError(f"{name} is {whose}, not a {role}: a {role} name calls only {calls}", _way_out(role))
    return obj


def refuse_before_import(name: str, role: str = MODEL_FACTORY) -> None:
    """Names refused from their spelling alone, before anything is imported (importing can act too)."""
    top = name.split(":")[0].split(".")[0]
    if top in sys.stdlib_module_names:
        raise LoadError(
            f"{name} is in Python's standard library, not a {role}: graphgrow does not call it", _way_out(role)
        )
    if top in _NEVER_FACTORIES:
        raise LoadError(f"{name} is in {top}, not a {role}: graphgrow does not call it", _way_out(role))


def library_of(obj: Any) -> str | None:
    """What defines obj, when it is not the user's own code: "Python's standard library", "graphgrow", an
    installed distribution's name. None for the user's code: a module outside every installation folder
    that no installed (non-editable) distribution owns — the current folder, PYTHONPATH, an editable
    install of the user's project. Looks where obj is defined (__module__), not where it was imported from."""
    home: str | None = getattr(obj, "__module__", None)
    module = sys.modules.get(home) if isinstance(home, str) else None
    if module is None:  # a builtin without a home, a partial, a module that is gone: cannot tell, so refused
        return f"an unknown module ({str(home)[:60]})"
    top = home.split(".")[0]
    if top in sys.stdlib_module_names:
        return "Python's standard library"
    if top in _NEVER_FACTORIES:
        return top
    file = getattr(module, "__file__", None)
    if not file:
        return f"the built-in module {home}"
    path = Path(file).resolve()
    if any(path.is_relative_to(folder) for folder in _installation_folders()):
        return _distribution_name(top)
    for dist in _distributions(top):
        if not _is_editable(dist) and _owns(dist, path):
            return str(dist.metadata["Name"] or top)
    return None


def _installation_folders() -> list[Path]:
    """Where installed packages and the standard library live (site-packages, dist-packages, stdlib)."""
    import site
    import sysconfig

    folders = [sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    with contextlib.suppress(AttributeError):  # site may be trimmed in embedded interpreters
        folders += [*site.getsitepackages(), site.getusersitepackages()]
    folders += [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    return [Path(f).resolve() for f in folders if f]


def _distributions(top: str) -> list[Any]:
    from importlib import metadata

    names = metadata.packages_distributions().get(top, [])
    found = []
    for n in dict.fromkeys(names):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found.append(metadata.distribution(n))
    return found


def _distribution_name(top: str) -> str:
    dists = _distributions(top)
    return (dists[0].metadata["Name"] or top) if dists else top


def _is_editable(dist: Any) -> bool:
    """pip's record of an editable install (PEP 610): the user's own project, whose code is theirs."""
    import json

    try:
        return bool(json.loads(dist.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable"))
    except (ValueError, AttributeError):
        return False


def _owns(dist: Any, path: Path) -> bool:
    return any(
        Path(str(dist.locate_file(f))).resolve() == path for f in (dist.files or ()) if str(f).endswith(path.name)
    )
