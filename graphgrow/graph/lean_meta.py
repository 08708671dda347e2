"""torch.export's per-node metadata without its memory-format queries (a speed-up; the graph is the same).

Each node torch.export (and the ONNX exporter's decomposition, which traces again) records gets `tensor_meta`, whose
`memory_format` field asks the output whether it is contiguous in each of three layouts. With symbolic sizes each
query is a sympy proof (`guard_or_false`: no guard is added, the graph does not change); on a chunked linear attention
(Qwen3.5's gated delta rule, its sizes holding `Mod(s, 64)`) these queries were 13 % of a trace's CPU time
(measured: 26.2 -> 22.5 CPU s per torch.export of the rule alone, graph text identical). Nothing graphgrow or the
exporters read takes the layout from `tensor_meta` (torch reads it only to rebuild a node's value when `val` is
missing, which a traced node always has): there it is None, as torch writes it for a layout it cannot decide."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def lean_tensor_meta() -> Iterator[None]:
    """Within: traced nodes' `tensor_meta` records no memory format (None). The tracer's function is restored after;
    with a torch that has no such function, nothing changes."""
    try:
        from torch.fx.experimental import proxy_tensor
    except ImportError:
        yield
        return
    extract = getattr(proxy_tensor, "_extract_tensor_metadata", None)
    if extract is None or getattr(extract, "_gg_lean", False):  # absent, or already lean (a nested use)
        yield
        return

    def lean(result: Any, include_contiguity: bool = True) -> Any:
        return extract(result, include_contiguity=False)

    lean._gg_lean = True  # type: ignore[attr-defined]
    proxy_tensor._extract_tensor_metadata = lean
    try:
        yield
    finally:
        proxy_tensor._extract_tensor_metadata = extract
