"""The plan of a streamed growth (stream_grow.py): what each window of a Hugging Face checkpoint holds and which of
the user's passes run on it, decided from the config, the safetensors headers and the meta device — no weights.

A transformer checkpoint is a stack of layers of one structure (`model.layers.{i}`) plus a few tensors around it
(embeddings, final norm, LM head). A *window* is the checkpoint's own class built with the same config but one layer
and a vocabulary of `chunk` rows: small whatever the model's size. The plan finds, by probing the class on the
meta device (never by model names):
- the stack: the ModuleList of repeated layers with the most parameters;
- the config field holding the layer count (set to 1, the window has one layer) and the one holding the vocabulary
  (set to `chunk`, the embedding and LM head have `chunk` rows);
- the vocabulary tensors: those with a dimension that follows the vocabulary field (read by rows);
- deepen(block=copy)'s copies: the user's deepen passes run on the whole model captured on the meta device (a copy
  needs the stack's shape, not its weights), giving which layer each copy comes from and the order the grown stack
  runs its layers in (native_depth.Deeper, as as_native numbers them).
Passes streamed: those that change every layer alike (grow_hidden, grow_heads and grow_width without a place in one
layer) and deepen(block=copy); a pass that names one layer (at=, target=) would give layers of different sizes,
which a native config cannot hold, and is refused, as is any other pass (NotApplicable with the reason).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.errors import LoadError, NotApplicable
from ..io.hf_folder import model_class, read_config, stored_bytes
from ..io.shards import LazyCheckpoint
from .native_depth import COPIES_KEY, Deeper, deeper_stacks

STREAMED = ("grow_hidden", "grow_heads", "grow_width", "deepen")
_PLACED = ("at", "target")  # arguments that name one place: streamed only when left to their default


@dataclass
class StreamPlan:
    folder: Path
    cls: type
    config: Any  # the checkpoint's own config (transformers object)
    stack: str  # e.g. model.layers
    layers: int  # the original's layer count
    count_field: str
    vocab: int
    vocab_field: str
    chunk: int  # vocabulary rows per window
    vocab_dims: dict[str, int]  # vocabulary tensors: name → the dimension that holds the vocabulary
    checkpoint: LazyCheckpoint
    passes: list  # the user's passes (Pass objects), in order
    deeper: Deeper | None = None
    copy_source: dict[int, int] = field(default_factory=dict)  # a copy's index → the index of the layer it copies
    stored_dtype: torch.dtype = torch.float32

    @property
    def order(self) -> list[int]:
        """The grown stack's layer indices in run order (its position is the output's layer number)."""
        return self.deeper.order if self.deeper else list(range(self.layers))

    def origin(self, index: int) -> int:
        return self.deeper.origin[index] if self.deeper else index

    def window_indices(self, s: int) -> list[int]:
        """The grown indices window `s` holds: layer s itself (window index 0), then its copies as deepen made them."""
        return [s] + sorted(g for g in self.order if g >= self.layers and self.origin(g) == s)

    def window_config(self, vocab_rows: int | None = None, no_dropout: bool = False, config: Any = None) -> Any:
        """The config of a window: one layer, `vocab_rows` (default: chunk) token ids; per-layer lists cut to the
        first entry; token ids past the window's vocabulary unset. `no_dropout`: every dropout probability 0."""
        c = copy.deepcopy(self.config if config is None else config)
        rows = self.chunk if vocab_rows is None else vocab_rows
        setattr(c, self.count_field, 1)
        setattr(c, self.vocab_field, rows)
        for k, v in c.to_dict().items():
            if isinstance(v, list) and len(v) == self.layers and k != "architectures":
                setattr(c, k, v[:1])
            if k.endswith("token_id") and isinstance(v, int) and v >= rows:
                setattr(c, k, None)
            if no_dropout and isinstance(v, float) and "dropout" in k:
                setattr(c, k, 0.0)
        c.use_cache = False
        return c


def _meta(cls: type, config: Any) -> nn.Module | None:
    try:
        with torch.device("meta"):
            return cls(copy.deepcopy(config))
    except Exception:  # noqa: BLE001 - a value the class refuses: that field is not the one probed for
        return None


def find_stack(model: nn.Module) -> tuple[str, int]:
    """The ModuleList of repeated layers (same parameter names) with the most parameters: (path, length)."""
    best: tuple[int, str, int] | None = None
    for path, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or not len(m):
            continue
        names = [sorted(n for n, _ in layer.named_parameters()) for layer in m]
        if not names[0] or any(n != names[0] for n in names):
            continue
        size = sum(p.numel() for p in m.parameters())
        if best is None or size > best[0]:
            best = (size, path, len(m))
    if best is None:
        raise NotApplicable(
            f"{type(model).__name__} has no stack of repeated layers: a checkpoint streams layer by layer",
            "grow it in memory (a smaller model, or a larger --max-memory)",
        )
    return best[1], best[2]


def _probe(cls: type, config: Any, value: int, new: int, moved: Any) -> str | None:
    """The integer config field equal to `value` whose setting to `new` makes `moved(model)` true."""
    for k, v in config.to_dict().items():
        if type(v) is not int or v != value or k.startswith("_"):
            continue
        probe = copy.deepcopy(config)
        try:
            setattr(probe, k, new)
        except Exception:  # noqa: BLE001 - a typed field that refuses the value holds something else
            continue
        m = _meta(cls, probe)
        if m is not None and moved(m):
            return k
    return None


def make_plan(folder: Path, passes: list, chunk_bytes: int = 16 << 20, chunk: int | None = None) -> StreamPlan:
    """The plan for growing `folder` by `passes` (module docstring). `chunk`: vocabulary rows per window (default:
    as many as make the two vocabulary tensors of a window a quarter of one layer in float32, or `chunk_bytes` if
    that is more; at least 64: a vocabulary window, which holds a layer too, then costs about what a layer window
    costs)."""
    _check_passes(passes)
    raw = read_config(folder)
    cls = model_class(folder, raw)
    from transformers import AutoConfig

    config = AutoConfig.for_model(**raw) if "model_type" in raw else None
    if config is None:
        raise LoadError(f"{folder}/config.json has no model_type", "save the model again with save_pretrained")
    checkpoint = LazyCheckpoint(folder)
    full = _meta(cls, config)
    if full is None:
        raise LoadError(f"{cls.__name__} cannot be built from {folder}/config.json", "check the config")
    shapes = {k: tuple(v.shape) for k, v in full.state_dict().items()}
    wrong = [k for k, s in checkpoint.shapes.items() if k in shapes and shapes[k] != s]
    if wrong:
        raise LoadError(
            f"{folder}: {wrong[0]} is {checkpoint.shapes[wrong[0]]} in the weights and {shapes[wrong[0]]} in the "
            "class built from the config",
            "check that the folder is complete",
        )
    stack, layers = find_stack(full)
    count_field = _probe(cls, config, layers, 1, lambda m: len(m.get_submodule(stack)) == 1)
    embedding = full.get_input_embeddings()
    vocab = int(getattr(embedding, "num_embeddings", 0) or embedding.weight.shape[0])
    width = int(embedding.weight.shape[-1])
    layer_bytes = 4 * sum(v.numel() for v in full.get_submodule(stack)[0].parameters())
    rows = chunk or max(64, min(vocab, max(chunk_bytes, layer_bytes // 4) // (4 * 2 * width)))
    rows = min(rows, vocab)
    probe = vocab - 1 if vocab > 1 else 2  # another size than the vocabulary's: the field and tensors that follow it
    vocab_field = _probe(cls, config, vocab, probe, lambda m: m.get_input_embeddings().weight.shape[0] == probe)
    if count_field is None or vocab_field is None:
        raise NotApplicable(
            f"no field of {type(config).__name__} sets the "
            + ("number of layers" if count_field is None else "vocabulary size")
            + f" of {cls.__name__}: the window model cannot be built",
            "grow it in memory",
        )
    small = _meta(cls, _with(config, {count_field: 1, vocab_field: probe}))
    assert small is not None  # both fields were probed one at a time; together they build too
    vocab_dims = {}
    for k, v in small.state_dict().items():
        if k in shapes and shapes[k] != tuple(v.shape):
            dims = [i for i, (a, b) in enumerate(zip(shapes[k], v.shape)) if a != b]
            if dims != [0] or shapes[k][0] != vocab:
                raise NotApplicable(
                    f"{k} {shapes[k]} changes along another dimension than its rows with the vocabulary",
                    "grow it in memory",
                )
            vocab_dims[k] = 0
    plan = StreamPlan(
        Path(folder),
        cls,
        config,
        stack,
        layers,
        count_field,
        vocab,
        vocab_field,
        rows,
        vocab_dims,
        checkpoint,
        list(passes),
        stored_dtype=_stored_dtype(checkpoint),
    )
    if any(p.name == "deepen" for p in passes):
        _plan_copies(plan, full)
    return plan


def _stored_dtype(checkpoint: LazyCheckpoint) -> torch.dtype:
    """The floating dtype the weights are stored in (hf_folder.load_folder's rule: one kind, else float32)."""
    _, _, dtypes = stored_bytes(checkpoint.files)
    floats = {d for d in dtypes if d in ("F32", "F16", "BF16", "F64")}
    kinds = {"BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
    return kinds.get(next(iter(floats)), torch.float32) if len(floats) == 1 else torch.float32


def _with(config: Any, values: dict[str, Any]) -> Any:
    c = copy.deepcopy(config)
    for k, v in values.items():
        setattr(c, k, v)
    return c


def _check_passes(passes: list) -> None:
    for p in passes:
        if p.name not in STREAMED:
            raise NotApplicable(
                f"{p.name} does not stream: a checkpoint grown window by window takes {', '.join(STREAMED)}",
                "grow it in memory (a smaller model, or a larger --max-memory)",
            )
        if p.name == "deepen" and p.block != "copy":
            raise NotApplicable(
                f"deepen(block={p.block}) does not stream: only block=copy (the model's own layer) keeps the "
                "checkpoint's class",
                "use deepen(block=copy)",
            )
        placed = [a for a in _PLACED if getattr(p, a, None) is not None]
        if placed:
            raise NotApplicable(
                f"{p.name}({placed[0]}=…) grows one place: streamed, every layer grows alike (a native config holds "
                "one size for all layers)",
                f"leave {placed[0]}= out, or grow it in memory",
            )


def _plan_copies(plan: StreamPlan, full: nn.Module) -> None:
    """deepen(block=copy)'s copies, from the user's deepen passes run on the whole model on the meta device."""
    from ..analysis.budget import Limits
    from ..capture.trace import trace
    from ..graph.graph_meta import graph_info, input_spec_of
    from ..graph.shapes import annotate
    from ..io.hf_zoo import default_spec
    from .pipeline import Pipeline

    meta = copy.deepcopy(full).eval()
    meta.config.use_cache = False
    gm = trace(meta, default_spec(meta.config, plan.cls, str(plan.folder)), check=False)
    annotate(gm, input_spec_of(gm))
    deepens = [p for p in plan.passes if p.name == "deepen"]
    pipeline = Pipeline(deepens, verify=False)
    pipeline.limits = Limits.parse("none", "1000T")  # nothing is allocated: the window sizes what runs
    result = pipeline.run(gm)
    found = [d for d in deeper_stacks(result.gm, meta) if d.stack == plan.stack]
    if not found or len(deeper_stacks(result.gm, meta)) != 1:
        raise NotApplicable(f"deepen(block=copy) did not copy layers of {plan.stack}", "grow it in memory")
    plan.deeper = found[0]
    for copy_path, source in (graph_info(result.gm).get(COPIES_KEY) or {}).items():
        plan.copy_source[int(copy_path.rpartition(".")[2])] = int(source.rpartition(".")[2])


def window_passes(plan: StreamPlan, s: int | None) -> list:
    """The passes window `s` runs (s None: a vocabulary window, which copies no layer): the user's, in order, each
    deepen(block=copy) made into a copy inside the window when it copies layer s or one of its copies (the k-th
    deepen made layer `layers + k`), dropped otherwise."""
    held = plan.window_indices(s) if s is not None else []
    local = {g: w for w, g in enumerate(held)}
    out, k = [], 0
    for p in plan.passes:
        if p.name != "deepen":
            out.append(p)
            continue
        made = plan.layers + k
        k += 1
        if made in local:
            source = local[plan.copy_source[made]]
            out.append(dataclasses.replace(p, after=f"{plan.stack}.0", source=source))
    return out
