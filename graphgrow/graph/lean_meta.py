"""torch.export's tracing without two costs that leave the graph the same (a speed-up for the capture and the ONNX
export, both of which trace under `lean_tensor_meta()`).

- Node metadata without memory-format queries. Each node torch.export (and the ONNX exporter's decomposition, which
  traces again) records gets `tensor_meta`, whose `memory_format` field asks the output whether it is contiguous in
  each of three layouts. With symbolic sizes each query is a sympy proof (`guard_or_false`: no guard is added, the
  graph does not change); on a chunked linear attention (Qwen3.5's gated delta rule, its sizes holding `Mod(s, 64)`)
  these queries were 13 % of a trace's CPU time (measured: 26.2 -> 22.5 CPU s per torch.export of the rule alone,
  graph text identical). Nothing graphgrow or the exporters read takes the layout from `tensor_meta` (torch reads it
  only to rebuild a node's value when `val` is missing, which a traced node always has): there it is None, as torch
  writes it for a layout it cannot decide.
- No fake-tensor dispatch cache. To make a cache entry, the fake mode builds the output a second time from the entry
  (a view's `set_` with symbolic sizes and strides is a sympy proof per dim) and checks it; an entry is only reused
  by a later call with the same op, arguments and sizes. In a chunked rule's unrolled forward substitution every
  step slices other rows, so nearly every entry is made and never used: 45 % of a trace (measured, the rule alone:
  16.3 -> 9.1 CPU s, graph text identical). On an ordinary model the cache saves nothing measurable either (hf llama
  deepen with --check --onnx: 18.2 -> 18.1 CPU s, ONNX byte-identical). The fake mode reads the setting when it is
  made, so it covers each trace begun inside."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def lean_tensor_meta() -> Iterator[None]:
    """Within: traced nodes' `tensor_meta` records no memory format (None), and fake modes made here keep no dispatch
    cache. The tracer's function and the setting are restored after; with a torch that has neither, nothing
    changes."""
    with _uncached_fakes():
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


@contextlib.contextmanager
def _uncached_fakes() -> Iterator[None]:
    try:
        from torch._dynamo import config
    except ImportError:
        yield
        return
    if not hasattr(config, "fake_tensor_cache_enabled"):
        yield
        return
    was = config.fake_tensor_cache_enabled
    config.fake_tensor_cache_enabled = False
    try:
        yield
    finally:
        config.fake_tensor_cache_enabled = was
