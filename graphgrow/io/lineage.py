"""Which model a grown model came from: a fingerprint of the original's structure, recorded by its first
pass and carried through every later pass, file and ONNX export.

The fingerprint covers parameter and buffer names, shapes and dtypes, not values: training between
growth events changes the values, not the lineage. `graphgrow diff` and `graphgrow replay` use it to
refuse two models that merely have the same mutation log (two different networks grown the same way).
"""

from __future__ import annotations

import hashlib
import re

from torch import fx, nn

from ..core.errors import InputError
from ..graph.graph_meta import graph_info

ORIGIN_KEY = "origin"
_ORIGIN = re.compile(r"sha256:[0-9a-f]{64}")


def structure_fingerprint(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return "sha256:" + h.hexdigest()


def is_origin(value: object) -> bool:
    return isinstance(value, str) and _ORIGIN.fullmatch(value) is not None


def origin_of(gm: fx.GraphModule) -> str | None:
    """The fingerprint of the model this one was grown from (itself when it has no mutation log);
    None for a grown model saved before origins were recorded."""
    info = graph_info(gm)
    if info.get(ORIGIN_KEY):
        return str(info[ORIGIN_KEY])
    return None if info.get("log") else structure_fingerprint(gm)


def record_origin(old: fx.GraphModule, new: fx.GraphModule) -> None:
    """After a pass: `new` keeps the origin of `old` (or `old` itself is the origin)."""
    origin = origin_of(old)
    if origin:
        graph_info(new)[ORIGIN_KEY] = origin


def require_lineage(a: fx.GraphModule, name_a: str, b: fx.GraphModule, name_b: str) -> str:
    """InputError unless B was grown from A (or is A): B's mutation log starts with A's and both come
    from the same original. Returns how that was established ("origin" or "log" for older files)."""
    log_a, log_b = graph_info(a).get("log", []), graph_info(b).get("log", [])
    origin_a, origin_b = origin_of(a), origin_of(b)
    if log_b[: len(log_a)] != log_a:
        if log_a[: len(log_b)] == log_b:
            raise InputError(
                f"{name_a} was grown from {name_b}, not the other way round",
                f"swap them: {name_b} first, then {name_a}",
            )
        raise InputError(
            f"{name_a} and {name_b} are not of one lineage (neither mutation log extends the other)",
            "compare a model with one grown from it, as graphgrow mutate writes them",
        )
    if origin_a and origin_b:
        if origin_a != origin_b:
            raise InputError(
                f"{name_b} was not grown from {name_a}: they start from different networks "
                "— the originals differ in parameter names or shapes",
                "compare a model with one grown from it, as graphgrow mutate writes them",
            )
        return "origin"
    return "log"
