"""The grown model back in the user's world: `as_native(grown, original)` returns an instance of the original's own
class — for a Hugging Face model, the same class with a new config and the grown weights — so `generate`,
`save_pretrained`, `labels=`, `attention_mask=`, the Trainer and PEFT work on it as on the original. Any other
model (timm, torchvision, a user's class) comes back as a copy with its resized layers swapped in
(native_resized.py).

The new config is solved, not guessed:
1. Attention: the grown graph's attentions (analysis/heads.py) give heads, key/value heads and head size; all
   attentions must agree (the config holds one value). A class that derives its head size from hidden_size /
   heads (no `head_dim` field) can hold only that head size.
2. Sizes: every integer config field that shapes a parameter is found by changing it on the meta device and seeing
   which parameter dimensions move (dim = a·value + b); each is then solved from the grown parameters' shapes.
3. Norms' eps (grow_hidden rescales them): the config's float field that held the original norms' eps takes the
   grown norms' eps.
4. Tied input and output embeddings stay tied only when the grown tensors are still equal.
The class is built from that config, the grown state dict loaded strictly (every parameter name must match: a
structural change the class cannot express — deepen's inserted block, a branch — is refused naming it), and the
result checked against the grown graph on the recorded inputs in eval mode (core.protocol's tolerance). A graph
grown in bfloat16 or float16 is rebuilt in that dtype (as from_pretrained builds it) and checked against the graph
in it, to one unit in its last place (a stand-in layer may round where the class's own does not, capture.standins);
a float32 graph of a half-precision folder is checked in float32, then converted. Layers deepen(block=copy) added
are numbered in the order they run, with the layer count and per-layer lists solved first (native_depth.py).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import NotApplicable
from ..core.state import module_dtype
from ..graph.float32_run import HALF, widened
from ..graph.graph_meta import input_spec_of
from .native_check import build, check, own_buffers
from .native_depth import check_moved, deeper_config, deeper_stacks, in_run_order, original_path
from .native_moe import has_mixtures, moe_native

_NOT_SIZES = {
    "vocab_size",
    "max_position_embeddings",
    "num_labels",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
    "cls_token_id",
    "type_vocab_size",
    "n_positions",
    "n_ctx",
    "image_size",
    "patch_size",
    "num_channels",
    "max_window_layers",
    "sliding_window",
    "chunk_size_feed_forward",
}


def is_hf_model(model: Any) -> bool:
    return hasattr(model, "config") and hasattr(model, "save_pretrained") and isinstance(model, nn.Module)


def as_native(
    grown: fx.GraphModule, original: nn.Module, stored_dtype: torch.dtype | None = None, use_cache: bool | None = None
) -> nn.Module:
    """The grown graph as an instance of `original`'s class; NotApplicable naming what the class cannot express.
    `stored_dtype`: the dtype to hand it back in (float32 otherwise); `use_cache`: the config's cache setting
    (default: the original config's, else True)."""
    if not is_hf_model(original):  # timm, torchvision, a user's class: the resized layers swapped into a copy
        from .native_resized import resized_copy

        return resized_copy(grown, original)
    if has_mixtures(grown):  # MLPs upcycled into mixtures of experts: the family's MoE class (native_moe.py)
        return moe_native(grown, original, stored_dtype, use_cache)
    cls = type(original)
    deeper = deeper_stacks(grown, original)  # layers deepen(block=copy) added: numbered in run order (native_depth)

    def class_state(g: fx.GraphModule, keep: set | None = None) -> dict[str, torch.Tensor]:
        state = _with_aliases(_class_layout(g, original, lambda p: original_path(p, deeper)), original)
        return {k: v for k, v in in_run_order(state, deeper).items() if keep is None or k in keep}

    grown_state = class_state(grown)
    base = deeper_config(original.config, cls, deeper, _meta_shapes) if deeper else original.config
    persistent = set(_meta_shapes(cls, base) or ()) if deeper else set(original.state_dict())
    _refuse_structure(grown_state, persistent, original, cls)
    shapes = {k: tuple(v.shape) for k, v in grown_state.items() if k in persistent}
    config = _solve_config(base, grown, cls, shapes)
    _set_eps(config, original, grown)
    _validate(config, cls)
    embeddings = original.get_input_embeddings()
    out = original.get_output_embeddings() if hasattr(original, "get_output_embeddings") else None
    if out is not None and getattr(config, "tie_word_embeddings", False):
        e_name = _param_name(original, embeddings.weight)
        o_name = _param_name(original, out.weight)
        if e_name and o_name and not torch.equal(grown_state[e_name], grown_state[o_name]):
            config.tie_word_embeddings = False  # the growth gave them different new rows: they are two tensors now
    if use_cache is None:  # the original's own setting (capture turns it off only while it captures)
        use_cache = getattr(original.config, "use_cache", None)
    if use_cache is not None or hasattr(config, "use_cache"):  # a class without a cache gets no such field
        config.use_cache = True if use_cache is None else bool(use_cache)
    grown_dtype = module_dtype(grown)
    native = build(cls, config, grown_dtype if grown_dtype in HALF else torch.float32)
    missing, unexpected = native.load_state_dict(
        {k: v for k, v in grown_state.items() if k in persistent}, strict=False
    )
    if missing or unexpected:
        raise NotApplicable(
            f"{cls.__name__} with the solved config has parameters the grown model has not, or the "
            f"reverse: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}",
            "keep the GraphModule",
        )
    if hasattr(native, "tie_weights") and getattr(config, "tie_word_embeddings", False):
        native.tie_weights()
    own_buffers(native, original)
    native.eval()
    with widened(native):  # a half-precision result is checked in float32 (verify.low_precision)
        check(grown, native, cls)
        if deeper:  # a copied layer is the identity until it learns: checked again with its zero tensors moved
            check_moved(grown, native, deeper, lambda g: class_state(g, persistent), lambda g, m: check(g, m, cls))
    if getattr(original, "generation_config", None) is not None:
        native.generation_config = copy.deepcopy(original.generation_config)
    if stored_dtype in HALF and stored_dtype != grown_dtype:
        native = native.to(stored_dtype)
    return native


def _class_layout(
    grown: fx.GraphModule, original: nn.Module, own_path: Callable[[str], str] = lambda p: p
) -> dict[str, torch.Tensor]:
    """The grown state dict in the class's own layout: a layer that capture raised to an nn.Linear with its weight
    transposed (GPT-2's Conv1D stores in × out) gets its weight transposed back, one raised to an nn.RMSNorm with
    weight 1 + w (Gemma's) gets w back; capture.standins decides, as it did.
    `own_path`: where the original holds a grown module (a copied layer: the layer it was copied from)."""
    from ..capture.standins import offset_weight, standin

    state = dict(grown.state_dict())
    for path, m in grown.named_modules():
        if not isinstance(m, (nn.Linear, nn.RMSNorm)):
            continue
        try:
            own = original.get_submodule(own_path(path))
        except AttributeError:
            continue
        weight = getattr(own, "weight", None)
        if isinstance(own, type(m)) or not isinstance(weight, torch.Tensor) or weight.dim() != m.weight.dim():
            continue
        raised = standin(own)
        if isinstance(raised, nn.Linear) and raised.weight is not weight:
            state[f"{path}.weight"] = state[f"{path}.weight"].t().contiguous()
        elif isinstance(raised, nn.RMSNorm):  # Gemma's RMSNorm scales by 1 + w: its own weight is the offset
            state[f"{path}.weight"] = offset_weight(own, raised, state[f"{path}.weight"])
    return state


def _validate(config: Any, cls: type) -> None:
    """The config's own checks (transformers validates a config when it is saved): a grown size it forbids is a
    refusal now, not a failure when the folder is written."""
    validate = getattr(config, "validate", None)
    if not callable(validate):
        return
    try:
        validate()
    except Exception as e:  # noqa: BLE001 - the config's own words
        cause = e.__cause__ or e
        raise NotApplicable(
            f"{type(config).__name__} refuses the grown sizes: {' '.join(str(cause).split())[:300]}",
            f"grow sizes {cls.__name__}'s config accepts (e.g. a hidden size that is a multiple of the heads)",
        ) from e


def _with_aliases(state: dict[str, torch.Tensor], original: nn.Module) -> dict[str, torch.Tensor]:
    """Names the original holds for one tensor (tied embeddings, BERT's prediction bias = its decoder's bias): the
    grown graph keeps one of them; the others get its tensor."""
    groups: dict[int, list[str]] = {}
    for k, v in original.state_dict(keep_vars=True).items():
        groups.setdefault(id(v), []).append(k)
    out = dict(state)
    for names in groups.values():
        present = [k for k in names if k in state]
        for k in names:
            if k not in out and present:
                out[k] = state[present[0]]
    return out


def _param_name(model: nn.Module, p: torch.Tensor) -> str | None:
    return next((k for k, v in model.state_dict(keep_vars=True).items() if v is p), None)


def _refuse_structure(grown: dict, persistent: set, original: nn.Module, cls: type) -> None:
    extra = sorted(k for k in grown if k not in persistent and k not in dict(original.named_buffers()))
    gone = sorted(k for k in persistent if k not in grown)
    if extra or gone:
        what = (
            (f"adds {', '.join(extra[:3])}" + (f" and {len(extra) - 3} more" if len(extra) > 3 else ""))
            if extra
            else f"removes {', '.join(gone[:3])}"
        )
        raise NotApplicable(
            f"the growth {what}: structure {cls.__name__} cannot express (only resized layers map back to its config)",
            "keep the GraphModule, or grow with passes that resize (grow_hidden, grow_heads, grow_width)",
        )


def _solve_config(old: Any, grown: fx.GraphModule, cls: type, shapes: dict[str, tuple]) -> Any:
    """The config whose class has the grown shapes: the attention's sizes first, then the others; or, for a class
    that derives its head size (hidden_size // heads) and cannot be built with the new heads before the new hidden
    size, the sizes first, then the attention, then the sizes again."""
    failures = []
    for attention_first in (True, False):
        config = copy.deepcopy(old)
        try:
            _pin_derived(config, cls)
            if attention_first:
                _set_attention(config, grown, cls)
            else:
                _solve_sizes(config, cls, shapes)
                _set_attention(config, grown, cls)
            _solve_sizes(config, cls, shapes)
            if getattr(old, "head_dim", None) is None and getattr(config, "head_dim", None) is not None:
                derived = copy.deepcopy(config)  # say head_dim only where the class would not derive the same
                _unset_head_dim(derived, old)
                if _meta_shapes(cls, derived) == _meta_shapes(cls, config):
                    _unset_head_dim(config, old)
            return config
        except NotApplicable as e:
            failures.append(e)
    raise failures[0]


def _pin_derived(config: Any, cls: type) -> None:
    """Write down the sizes a class derives from others when its config leaves them None (GPT-2's n_inner is
    4 × n_embd): probed by giving the field a value and seeing the shapes it sets (dim = value × slope), so growing
    the hidden size does not silently grow them too."""
    now = _meta_shapes(cls, config)
    if now is None:
        return
    for field, value in config.to_dict().items():
        if value is not None or field.startswith("_"):
            continue
        moved = _meta_shapes(cls, _with(config, field, 1024))
        if moved is None:
            continue
        derived = {
            now[k][i] * 1024 / moved[k][i]
            for k in now
            if k in moved and len(now[k]) == len(moved[k])
            for i in range(len(now[k]))
            if now[k][i] != moved[k][i]
        }
        if len(derived) == 1:
            v = derived.pop()
            if v > 0 and math.isclose(v, round(v)):
                setattr(config, field, int(round(v)))


def _unset_head_dim(config: Any, old: Any) -> None:
    """head_dim back as the original config had it: None, or no such attribute at all."""
    if hasattr(old, "head_dim"):
        config.head_dim = None
    elif "head_dim" in vars(config):
        delattr(config, "head_dim")


def _set_attention(config: Any, grown: fx.GraphModule, cls: type) -> None:
    from ..analysis.heads import find_attentions
    from ..graph.shapes import annotate

    if any("gg_shape" not in n.meta for n in grown.graph.nodes):
        annotate(grown, input_spec_of(grown))
    try:
        attentions = find_attentions(grown, set())
    except NotApplicable:
        return  # no attention the analysis reads: the sizes below must account for every shape
    found = {(a.heads, a.kv_heads, a.head_dim, a.value_dim) for a in attentions}
    if len(found) > 1:
        raise NotApplicable(
            f"the grown attentions differ ({sorted(found)}): {cls.__name__}'s config holds one head "
            "count and size for every layer",
            "grow every attention alike (grow_heads without at=)",
        )
    heads, kv, d, e = found.pop()
    if d != e and not hasattr(config, "v_head_dim"):
        raise NotApplicable(
            f"the grown attention's value head size ({e}) differs from its query/key head size ({d}): "
            f"{cls.__name__}'s config has one head_dim",
            "grow head_dim and value_dim together",
        )
    if hasattr(config, "num_attention_heads"):
        config.num_attention_heads = heads
    if hasattr(config, "num_key_value_heads") and getattr(config, "num_key_value_heads", None) is not None:
        config.num_key_value_heads = kv
    # most classes read head_dim when the config has it, else hidden_size // heads: say it (a class that ignores it
    # derives the size, and the shapes solved below show whether the grown one fits)
    config.head_dim = d
    if hasattr(config, "v_head_dim"):
        config.v_head_dim = e


def _with(config: Any, field: str, value: int) -> Any:
    """A copy of `config` with one field changed; None when the config refuses the value (typed fields)."""
    probe = copy.deepcopy(config)
    try:
        setattr(probe, field, value)
    except Exception:  # noqa: BLE001 - a strict config field that does not hold a size
        return None
    return probe


def _meta_shapes(cls: type, config: Any) -> dict[str, tuple] | None:
    if config is None:
        return None
    try:
        with torch.device("meta"):
            model = cls(copy.deepcopy(config))
    except Exception:  # noqa: BLE001 - a value the class refuses: that field cannot be probed this way
        return None
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _why_not(cls: type, config: Any) -> str:
    try:
        with torch.device("meta"):
            cls(copy.deepcopy(config))
    except Exception as e:  # noqa: BLE001 - the class's own words
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return "it builds now"


def _size_fields(config: Any) -> list[str]:
    data = config.to_dict()
    return [
        k
        for k, v in data.items()
        if isinstance(v, int)
        and not isinstance(v, bool)
        and v > 0
        and k not in _NOT_SIZES
        and not k.endswith("_token_id")
        and not k.startswith("_")
    ]


def _solve_sizes(config: Any, cls: type, target: dict[str, tuple]) -> None:
    """Set each integer field that shapes a parameter to the value the grown shapes need (module docstring, 2)."""
    for _ in range(4):  # a field solved can make another solvable (head size derived from hidden / heads)
        now = _meta_shapes(cls, config)
        if now is None:
            raise NotApplicable(
                f"{cls.__name__} cannot be built with the grown sizes ({_why_not(cls, config)})",
                "grow sizes the class can hold together (e.g. hidden size = heads × head size where it "
                "derives one from the others), or keep the GraphModule",
            )
        wrong = {(k, i) for k, s in target.items() if k in now for i, (a, b) in enumerate(zip(now[k], s)) if a != b}
        if not wrong:
            return
        progress = False
        for field in _size_fields(config):
            old = getattr(config, field)
            moved = _meta_shapes(cls, _with(config, field, 2 * old))
            if moved is None:
                continue
            deps = {
                (k, i): (now[k][i], moved[k][i])
                for k in now
                if k in moved and len(now[k]) == len(moved[k])
                for i in range(len(now[k]))
                if now[k][i] != moved[k][i]
            }
            if not any(key in wrong for key in deps):
                continue
            needs: dict[float, tuple[str, int]] = {}
            for (k, i), (a0, a1) in deps.items():  # every dimension the field moves must agree on its value
                need = old + (target[k][i] - a0) * old / (a1 - a0)
                needs.setdefault(need, (k, i))
            if len(needs) > 1:
                (v1, (k1, _)), (v2, (k2, _)) = list(needs.items())[:2]
                raise NotApplicable(
                    f"'{k1}' needs {field}={v1:g} and '{k2}' needs {field}={v2:g}: no {cls.__name__} "
                    "config gives both grown shapes (one value per field for every layer; some "
                    "classes derive one size from another, e.g. head size = hidden size / heads)",
                    "grow every layer alike and sizes the class can hold together, or keep the GraphModule",
                )
            need = next(iter(needs))
            if not (need > 0 and math.isclose(need, round(need))):
                continue
            setattr(config, field, int(round(need)))
            progress = True
            break  # shapes changed: measure again
        if not progress:
            k, i = sorted(wrong)[0]
            raise NotApplicable(
                f"no {cls.__name__} config gives '{k}' the grown shape {target[k]} (it would be "
                f"{now[k]}): the class cannot express this growth",
                "grow every layer alike, or keep the GraphModule",
            )
    raise NotApplicable(f"the config of {cls.__name__} did not settle on the grown shapes", "keep the GraphModule")


def _norm_eps(model: nn.Module) -> dict[str, float]:
    out = {}
    for name, m in model.named_modules():
        for attr in ("eps", "variance_epsilon", "epsilon"):
            v = getattr(m, attr, None)
            if isinstance(v, float) and "norm" in type(m).__name__.lower():
                out[name] = v
                break
    return out


def _set_eps(config: Any, original: nn.Module, grown: fx.GraphModule) -> None:
    before, after = _norm_eps(original), _norm_eps(grown)
    changed = {after[k] for k in before if k in after and after[k] != before[k]}
    if not changed:
        return
    if len(changed) > 1:
        raise NotApplicable(
            f"the grown norms have different eps ({sorted(changed)}): the config holds one", "keep the GraphModule"
        )
    new_eps = changed.pop()
    old = set(before.values())
    fields = [k for k, v in config.to_dict().items() if isinstance(v, float) and v in old and "eps" in k]
    if not fields:
        raise NotApplicable(
            "the growth rescaled the norms' eps and the config has no eps field holding it", "keep the GraphModule"
        )
    for f in fields:
        setattr(config, f, new_eps)


def native_of(grown: fx.GraphModule, loaded: Any, progress: Callable[[str], None]) -> nn.Module:
    """as_native for the CLI: the loaded model's class, dtype and cache setting; a refusal says the growth itself
    verified and how to keep it."""
    progress(f"rebuilding {type(loaded.module).__name__} with the grown config")
    try:
        return as_native(grown, loaded.module, loaded.stored_dtype, loaded.use_cache)
    except NotApplicable as e:
        keep = "write graphgrow's own file: -o NAME.pt"
        raise NotApplicable(f"the growth verified, but {e.message}", f"{e.hint}; or {keep}" if e.hint else keep) from e


def native_report(original: nn.Module, native: nn.Module) -> dict:
    """The report's `native`: class, dtype and the config fields the growth changed ({field: [before, after]})."""
    a, b = original.config.to_dict(), native.config.to_dict()
    skip = ("use_cache", "dtype", "torch_dtype", "transformers_version")
    return {
        "class": type(native).__name__,
        "dtype": str(native.dtype).removeprefix("torch."),
        "config": {k: [a.get(k), v] for k, v in b.items() if a.get(k) != v and k not in skip},
    }
