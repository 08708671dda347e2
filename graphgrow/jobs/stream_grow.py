"""Growth of a Hugging Face checkpoint larger than memory, window by window (docs/streaming.md).

`grow_streaming(folder, specs, out)`: the plan is made without weights (stream_plan.py). Then, for each layer s of the
stack, the window model (the class with one layer and a vocabulary chunk) gets layer s's tensors read lazily from the
safetensors, is captured, and runs the user's passes — the same passes with the same arguments, deepen(block=copy)
placed inside the window (stream_plan.window_passes), with a seed derived from the user's seed and the window so new
random weights differ from layer to layer. The grown layer (and its copies) is taken in the class's own layout
(as as_native does), numbered where the grown stack runs it, and written in the checkpoint's dtype. The
vocabulary tensors (embeddings, LM head) grow the same way, a chunk of rows per window: their growth must be the
same rule row by row (grow_hidden's zero or mean fill, random reader columns), which the window checks (a
replicated-coordinates rule draws one order for the whole stream and is refused). Tensors outside the stack that are
not vocabulary-sized (the final norm) come from the first vocabulary window.

The passes are verified in full (eval, train, trainability: verify.preserve) on the first layer window and the first
vocabulary window, and as_native rebuilds the first layer window in its class with the grown config (the config
fields it changed are the grown checkpoint's, with the layer count solved as for deepen). Every window after
those runs unverified; the whole result is then checked by the streamed verification (stream_verify.py) from the
written shards before the folder is committed (io/shards.ShardWriter): a failure leaves no folder.
"""

from __future__ import annotations

import copy
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..analysis.budget import Limits
from ..core.errors import NotApplicable
from ..io.hf_folder import read_config
from ..io.shards import LazyCheckpoint, ShardWriter
from .opening import Progress, _noop
from .pipeline import Pipeline
from .stream_plan import StreamPlan, make_plan, window_passes
from .stream_verify import _load, layer_tensors, verify_streamed, vocab_rows

_NOT_CHANGED = {"dtype", "torch_dtype", "use_cache", "transformers_version", "architectures"}


LAYER_WINDOW_ROWS = 256  # vocabulary rows of a layer window: enough for its verification's token ids
IN_MEMORY_FACTOR = (
    2.4  # peak ÷ the weights as loaded, of an in-memory growth (passes, verification, save: performance.md)
)


def stream_reason(folder: Path, max_memory: int | None) -> str | None:
    """Why `folder` is grown by streaming (None: it fits in memory): its weights as the in-memory path loads them
    (hf_folder.load_folder: float32, bfloat16 and float16 as stored, anything else in float32) times
    IN_MEMORY_FACTOR, a lower bound of an in-memory growth's peak, exceed `max_memory` (None: the default
    --max-memory)."""
    from ..analysis.budget import DEFAULT_MAX_MEMORY
    from ..io.hf_folder import stored_bytes, weight_files

    limit = DEFAULT_MAX_MEMORY if max_memory is None else max_memory
    stored, count, dtypes = stored_bytes(weight_files(folder))
    floats = {d for d in dtypes if d in ("F32", "F16", "BF16", "F64")}
    loaded = stored if len(floats) == 1 and floats <= {"F32", "BF16", "F16"} else count * 4
    need = loaded * IN_MEMORY_FACTOR
    if need <= limit:
        return None
    return (
        f"grown in memory it would need at least {_size(need)} ({count:,} values, {_size(loaded)} loaded, × "
        f"{IN_MEMORY_FACTOR}), over --max-memory {_size(limit)}"
    )


def _size(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def release_freed() -> None:
    """Hand the heap's freed blocks back to the system after a window (glibc's malloc_trim; nothing elsewhere):
    glibc keeps freed tensors of tens of MB in its heap, and each window would otherwise add to the peak."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to hand back this way
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def window_seed(seed: int, k: int) -> int:
    """The seed of window k: the user's seed moved by a large prime per window (new weights differ per layer)."""
    return (seed + 1_000_003 * (k + 1)) % 2**63


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


class Window:
    """The window model (the class with one layer and a vocabulary chunk) and its capture. Capture shares the
    module's parameters, so a window's tensors loaded into the module in place are the graph's too and it is captured
    once; a class whose capture holds some of them in another layout (capture.standins: a transposed Conv1D) is
    captured again for each window."""

    def __init__(self, plan: StreamPlan, rows: int) -> None:
        self.plan = plan
        self.module = plan.cls(plan.window_config(rows)).float().eval()
        self.gm: Any = None
        self.shared = False

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        _load(self.module, tensors)
        if not self.shared:
            self.gm = None

    def graph(self) -> Any:
        from ..capture.trace import trace
        from ..graph.graph_meta import input_spec_of
        from ..graph.shapes import annotate
        from ..io.hf_zoo import default_spec

        if self.gm is None:
            spec = default_spec(self.module.config, self.plan.cls, str(self.plan.folder))
            self.gm = trace(self.module, spec, check=False)
            annotate(self.gm, input_spec_of(self.gm))
            own = self.module.state_dict(keep_vars=True)
            held = self.gm.state_dict(keep_vars=True)
            self.shared = all(k in held and held[k].data_ptr() == v.data_ptr() for k, v in own.items() if v.numel())
        return self.gm


def grow_window(
    window: Window, passes: list, seed: int, verify: bool, native: bool = False
) -> tuple[dict[str, torch.Tensor], Any, list]:
    """The window's passes run on its capture: its grown state in the class's layout (copies under their window
    index), the native config when `native` (as_native on the window, checked against the graph), and the results.
    The state may share tensors with the window: use them before the next window is loaded."""
    from .native import _class_layout, _with_aliases, as_native
    from .native_depth import deeper_stacks, original_path

    if not passes:
        return dict(window.module.state_dict()), None, []
    pipeline = Pipeline(passes, verify=verify, seed=seed, share=True)
    pipeline.limits = Limits.parse("none", None)  # the window, not the checkpoint, is what runs
    result = pipeline.run(window.graph())
    module = window.module
    deeper = deeper_stacks(result.gm, module)
    state = _with_aliases(_class_layout(result.gm, module, lambda p: original_path(p, deeper)), module)
    config = as_native(result.gm, module).config if native else None
    return state, config, result.results


def _refuse_shared_draws(results: list) -> None:
    """A rule that draws one random order for the whole stream (grow_hidden replicating coordinates on a post-norm
    stream) would draw another in each window: refused, naming it."""
    for r in results:
        rule = str(r.targets.get("rule", ""))
        if r.name == "grow_hidden" and "replicated" in rule:
            raise NotApplicable(
                f"grow_hidden grows this stream by replicating coordinates in one random order ({rule}); windows "
                "grown one by one would each draw their own order",
                "grow it in memory",
            )


def _changed_fields(before: Any, after: Any, plan: StreamPlan) -> dict[str, Any]:
    a, b = before.to_dict(), after.to_dict()
    skip = _NOT_CHANGED | {plan.count_field, plan.vocab_field}
    return {k: v for k, v in b.items() if a.get(k) != v and k not in skip}


def grown_config(plan: StreamPlan, changed: dict[str, Any]) -> Any:
    """The whole grown model's config: the layer count and per-layer lists as deepen made them (native_depth), then
    every field the growth changed in the window."""
    from .native import _meta_shapes
    from .native_depth import deeper_config

    config = (
        deeper_config(plan.config, plan.cls, [plan.deeper], _meta_shapes) if plan.deeper else copy.deepcopy(plan.config)
    )
    for k, v in changed.items():
        setattr(config, k, v)
    return config


def _check_shapes(plan: StreamPlan, config: Any, written: dict[str, tuple]) -> None:
    """The class built from the grown config (meta device) has exactly the written tensors' shapes."""
    from .native import _meta_shapes

    shapes = _meta_shapes(plan.cls, config)
    if shapes is None:
        raise NotApplicable(f"{plan.cls.__name__} cannot be built with the grown config", "grow it in memory")
    wrong = [k for k, s in written.items() if shapes.get(k) != s]
    if wrong:
        raise NotApplicable(
            f"{plan.cls.__name__} with the grown config has {wrong[0]} {shapes.get(wrong[0])}, the growth wrote "
            f"{written[wrong[0]]}: the class cannot express this growth",
            "grow it in memory and keep the GraphModule",
        )


def grow_streaming(
    folder: str | Path,
    specs: Sequence[str],
    out: str | Path,
    *,
    seed: int = 0,
    progress: Progress = _noop,
    shard_bytes: int = 1 << 30,
    chunk: int | None = None,
    verify_windows: str = "first",
    reason: str | None = None,
) -> dict:
    """Grow the Hugging Face folder `folder` by `specs` into the new folder `out`, window by window (module
    docstring). `chunk`: vocabulary rows per window (default: stream_plan's). `verify_windows`: "first" (the first
    layer and vocabulary windows verified in full) or "all" (every window). `reason`: why it streams (the report
    says it). Returns the report, shaped as mutate's."""
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    passes = Pipeline.from_spec(list(specs), seed=seed).passes  # spec errors before any work
    progress(f"planning {folder} on the meta device")
    plan = make_plan(Path(folder), passes, chunk=chunk)
    timings["plan"] = time.perf_counter() - t0
    dtype = plan.stored_dtype if plan.stored_dtype.is_floating_point else torch.float32
    layer_names = {
        k.partition(f"{plan.stack}.0.")[2] for k in plan.checkpoint.shapes if k.startswith(f"{plan.stack}.0.")
    }
    outside = [k for k in plan.checkpoint.shapes if not k.startswith(plan.stack + ".")]
    written: dict[str, tuple] = {}
    results: list = []
    with ShardWriter(Path(out), shard_bytes) as writer:
        # built once for the layers, once for the vocabulary: each window's tensors are loaded into it. A layer window
        # needs only a few vocabulary rows (its embedding and head are not kept); a vocabulary window, a chunk
        few = min(LAYER_WINDOW_ROWS, plan.vocab)
        window = Window(plan, few)
        first_rows = vocab_rows(plan, plan.checkpoint, list(range(few)), size=few)
        changed: dict[str, Any] | None = None
        t = time.perf_counter()
        for s in range(plan.layers):
            progress(f"growing layer {s + 1}/{plan.layers} ({len(plan.window_indices(s))} in the grown stack)")
            window.load({**first_rows, **layer_tensors(plan, plan.checkpoint, s)})
            state, config, res = grow_window(
                window, window_passes(plan, s), window_seed(seed, s), verify_windows == "all" or s == 0, s == 0
            )
            if s == 0:
                _refuse_shared_draws(res)
                results = [r.to_json() for r in res]  # not the results: they hold the window's grown graphs
                changed = _changed_fields(plan.window_config(), config, plan) if config is not None else {}
            for w, g in enumerate(plan.window_indices(s)):
                pos = plan.order.index(g)
                for name in sorted(layer_names):
                    v = state[f"{plan.stack}.{w}.{name}"]
                    writer.add(f"{plan.stack}.{pos}.{name}", v.to(dtype=dtype, copy=True))
                    written[f"{plan.stack}.{pos}.{name}"] = tuple(v.shape)
            del state, res
            release_freed()
        timings["layers"] = time.perf_counter() - t
        t = time.perf_counter()
        sinks: dict[str, Any] = {}
        vocab_pass = window_passes(plan, None)
        del window
        release_freed()
        window = Window(plan, plan.chunk)
        window.load(layer_tensors(plan, plan.checkpoint, 0))
        for j, start in enumerate(range(0, plan.vocab, plan.chunk)):
            rows = list(range(start, min(start + plan.chunk, plan.vocab)))
            progress(f"growing the vocabulary rows {start:,}–{rows[-1]:,} of {plan.vocab:,}")
            window.load(vocab_rows(plan, plan.checkpoint, rows))
            state, _, _ = grow_window(
                window, vocab_pass, window_seed(seed, plan.layers + j), verify_windows == "all" or j == 0
            )
            for k in plan.vocab_dims:
                if k not in outside:
                    continue  # a name the checkpoint does not hold (a tied head)
                v = state[k][: len(rows)]
                if k not in sinks:  # the vocabulary tensors are written by rows, never held whole
                    sinks[k] = writer.rows(k, (plan.vocab, *v.shape[1:]), dtype)
                    written[k] = (plan.vocab, *v.shape[1:])
                sinks[k].write(v.to(dtype))
            if j == 0:
                for k in outside:
                    if k not in plan.vocab_dims:
                        writer.add(k, state[k].to(dtype=dtype, copy=True))
                        written[k] = tuple(state[k].shape)
            del state
            release_freed()
        for sink in sinks.values():
            sink.close()
        del window
        release_freed()  # the window and its capture are cyclic garbage: collected now, not during verification
        timings["vocabulary"] = time.perf_counter() - t
        config = grown_config(plan, changed or {})
        _check_shapes(plan, config, written)
        writer.flush()
        t = time.perf_counter()
        staged = LazyCheckpoint.of_files([p for p, _ in writer.shards])
        verification = verify_streamed(plan, staged, config, progress)
        timings["verify"] = time.perf_counter() - t
        raw = read_config(Path(folder))
        config.dtype = dtype
        data = config.to_diff_dict()  # as save_pretrained writes it: the fields that differ from the defaults
        if "use_cache" in raw:
            data["use_cache"] = raw["use_cache"]
        progress(f"writing {out}")
        writer.commit(data, source=Path(folder))
        shards = len(writer.shards)
    timings["total"] = time.perf_counter() - t0
    from ..io.hf_zoo import default_spec
    from .opening import shape_report

    windowed = f"streamed: figures of the first layer window (one layer, {plan.chunk:,} vocabulary rows)"
    return {
        "model": str(folder),
        **shape_report(default_spec(plan.config, plan.cls, str(folder))),
        "passes": [{**r, "notes": [*r.get("notes", []), windowed]} for r in results],
        "output_note": (
            f"streamed{f' ({reason})' if reason else ''}: grown window by window, {len(plan.order)} layers, "
            f"verified side by side (logits rel err {verification['eval']['logits_rel_err']:.1e} eval, "
            f"{verification['train']['logits_rel_err']:.1e} train; tolerance {verification['tolerance']:.1e}); "
            f"peak RSS {peak_rss_mib():,.0f} MiB"
        ),
        "streamed": {
            "layers": f"{plan.layers} → {len(plan.order)}",
            "vocabulary_chunk": plan.chunk,
            "windows": plan.layers + -(-plan.vocab // plan.chunk),
            "verified_windows": verify_windows,
            "shards": shards,
            "peak_rss_mib": round(peak_rss_mib(), 1),
        },
        "preservation": verification,
        "native": {
            "class": plan.cls.__name__,
            "dtype": str(dtype).removeprefix("torch."),
            "config": {k: [plan.config.to_dict().get(k), v] for k, v in data.items() if k in (changed or {})}
            | ({plan.count_field: [plan.layers, len(plan.order)]} if plan.deeper else {}),
        },
        "outputs": [str(out)],
        "timings": timings,
    }
