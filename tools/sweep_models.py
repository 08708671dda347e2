"""The models a sweep runs (tools/sweep.py): each registry as a list of Runs' model halves — a model name the CLI
builds (`torchvision:NAME`, `timm:NAME`, `hf:TYPE/TASK(config)`), the extra CLI arguments it needs (a small input
shape), nothing else. Listing a registry builds nothing: torchvision and timm are read from their registries,
transformers' configs are instantiated with their defaults (no weights, no download) to see which size fields they
have, and shrunk by setting those that exist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass, field

PASSES = ("grow_width", "add_residual", "deepen", "add_branch", "insert_adapter", "grow_hidden", "grow_heads")


@dataclass(frozen=True)
class Model:
    registry: str
    key: str  # short, unique within the registry: the table's row
    name: str  # what `graphgrow mutate` is given
    args: tuple[str, ...] = field(default=())  # extra CLI arguments (input shape)


# ---------------------------------------------------------------- torchvision
def _torchvision_args(name: str, kind: str) -> tuple[str, tuple[str, ...]]:
    """(name with arguments, CLI arguments): the smallest input the builder takes, found by reading its code."""
    if kind == "video":
        if name.startswith("mvit"):  # fixed 16 × 224 × 224 positional embeddings
            return f"torchvision:{name}", ("--input-shape", "1,3,16,224,224")
        if name == "s3d":  # a 2 × 7 × 7 average pool at the end: 16 frames of 224 / 32 = 7
            return f"torchvision:{name}", ("--input-shape", "1,3,16,224,224")
        return f"torchvision:{name}", ("--input-shape", "1,3,4,32,32")
    if kind == "optical_flow":  # two frames, sides a multiple of 8 (128: its correlation pyramid has 4 levels)
        return f"torchvision:{name}", (
            "--input",
            "image1:float32[1,3,128,128]",
            "--input",
            "image2:float32[1,3,128,128]",
        )
    if kind == "detection":  # the transform resizes every image to min_size: keep it small
        if name.startswith("ssd"):
            return f"torchvision:{name}", ("--input-shape", "1,3,128,128")
        return f"torchvision:{name}(min_size=128, max_size=128)", ("--input-shape", "1,3,128,128")
    if kind == "segmentation":
        return f"torchvision:{name}", ("--input-shape", "1,3,64,64")
    if name.startswith("vit_h"):  # patch 14
        return f"torchvision:{name}(image_size=56)", ("--input-shape", "1,3,56,56")
    if name.startswith("vit_"):  # fixed positional embeddings: the image size is an argument
        return f"torchvision:{name}(image_size=64)", ("--input-shape", "1,3,64,64")
    if name == "maxvit_t":  # partitions of 7 at every stage: 224 is the smallest
        return f"torchvision:{name}", ("--input-shape", "1,3,224,224")
    if "inception_v3" in name:  # 75 is the smallest its stem takes
        return f"torchvision:{name}", ("--input-shape", "1,3,96,96")
    return f"torchvision:{name}", ("--input-shape", "1,3,64,64")


def torchvision_models() -> list[Model]:
    import torchvision.models as tvm

    kinds = {
        "detection": tvm.detection,
        "segmentation": tvm.segmentation,
        "video": tvm.video,
        "optical_flow": tvm.optical_flow,
        "quantization": tvm.quantization,
    }
    kind_of = {n: k for k, mod in kinds.items() for n in tvm.list_models(module=mod)}
    order = {"classification": 0, "quantization": 1, "segmentation": 2, "detection": 3, "video": 4, "optical_flow": 5}
    names = sorted(tvm.list_models(), key=lambda n: (order[kind_of.get(n, "classification")], n))
    out = []
    for n in names:
        name, args = _torchvision_args(n, kind_of.get(n, "classification"))
        out.append(Model("torchvision", n, name, args))
    return out


# ---------------------------------------------------------------- timm
_SIZE_WORDS = ["atto", "femto", "pico", "nano", "xxxs", "xxs", "xs", "tiny", "mini", "micro", "small", "s", "lite"]


def _size_rank(name: str) -> tuple:
    """Smaller variants first: a size word early in the list, then small numbers in the name, then a short name."""
    parts = re.split(r"[_\-]", name)
    word = min((_SIZE_WORDS.index(p) for p in parts if p in _SIZE_WORDS), default=len(_SIZE_WORDS))
    nums = [int(x) for x in re.findall(r"\d+", name)] or [0]
    return (word, nums[0] if len(nums) else 0, len(name), name)


TIMM_SIZES = (64, 96, 112, 128, 160, 224)  # tried in order where a model takes sizes other than its own


def _timm_size(name: str, channels: int) -> str:
    """'H,W' for a timm model that is not fixed to its size: the first of TIMM_SIZES it runs at, built and run on the
    meta device (a second or less; nothing is allocated). 64 does not suit every such model: a patch size that does
    not divide it (DeepSeek's ViT: 14; the model asserts it), a halo attention whose blocks need a larger map
    (HaloRegNetZ). Where none runs (a model the meta device cannot run), 64, as before."""
    import timm
    import torch

    try:
        with torch.device("meta"):
            model = timm.create_model(name).eval()
    except Exception:
        return "64,64"
    for size in TIMM_SIZES:
        try:
            with torch.no_grad():
                model(torch.empty(1, channels, size, size, device="meta"))
        except Exception:
            continue
        return f"{size},{size}"
    return "64,64"


def _timm_fixed_size(name: str, channels: int, own: int) -> int | None:
    """The first of TIMM_SIZES smaller than `own` at which a model fixed to its size (a ViT's position table) builds
    with `img_size` (timm's keyword for it) and runs, on the meta device; None when there is none. The issue asks
    for small inputs: a base ViT at 224 costs the sweep twelve times the tokens of one at 64."""
    import timm
    import torch

    for size in (s for s in TIMM_SIZES if s < own):
        try:
            with torch.device("meta"):
                model = timm.create_model(name, img_size=size).eval()
            with torch.no_grad():
                model(torch.empty(1, channels, size, size, device="meta"))
        except Exception:
            continue
        return size
    return None


def timm_models() -> list[Model]:
    import timm
    from timm.models import get_pretrained_cfg

    out = []
    for module in sorted(timm.list_modules()):
        names = timm.list_models(module=module)
        if not names:
            continue
        name = min(names, key=_size_rank)
        cfg = get_pretrained_cfg(name)
        fixed = bool(getattr(cfg, "fixed_input_size", False)) if cfg is not None else False
        channels = (getattr(cfg, "input_size", None) or (3,))[0] if cfg is not None else 3
        # a model that takes any size gets 64×64, or the smallest size it runs at; a fixed one is built for the
        # smallest size it takes as img_size, else keeps its own (the CLI reads it from the cfg)
        if not fixed:
            out.append(Model("timm", f"{module}/{name}", f"timm:{name}", _shape(channels, _timm_size(name, channels))))
            continue
        own = (getattr(cfg, "input_size", None) or (3, 224, 224))[-1]
        small = _timm_fixed_size(name, channels, own)
        spelled = f"timm:{name}(img_size={small})" if small else f"timm:{name}"
        out.append(Model("timm", f"{module}/{name}", spelled, _shape(channels, f"{small},{small}") if small else ()))
    return out


def _shape(channels: int, size: str) -> tuple[str, ...]:
    return ("--input-shape", f"1,{channels},{size}")


# ---------------------------------------------------------------- transformers
HF_TASKS = (
    ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
)
_AUTO = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "image-classification": "AutoModelForImageClassification",
}
HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, IMAGE = 64, 2, 4, 2, 256, 32
# field → value for every scalar size field a config may have (set only where the config class has it)
_SCALARS = {
    "hidden_size": HIDDEN,
    "n_embd": HIDDEN,
    "d_model": HIDDEN,
    "dim": HIDDEN,
    "embed_dim": HIDDEN,
    "num_hidden_layers": LAYERS,
    "n_layer": LAYERS,
    "n_layers": LAYERS,
    "num_layers": LAYERS,
    "encoder_layers": LAYERS,
    "decoder_layers": LAYERS,
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "n_heads": HEADS,
    "num_heads": HEADS,
    "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HIDDEN // HEADS,
    "intermediate_size": 2 * HIDDEN,
    "n_inner": 2 * HIDDEN,
    "ffn_dim": 2 * HIDDEN,
    "d_ff": 2 * HIDDEN,
    "encoder_ffn_dim": 2 * HIDDEN,
    "decoder_ffn_dim": 2 * HIDDEN,
    "moe_intermediate_size": HIDDEN,
    "shared_expert_intermediate_size": HIDDEN,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "rotary_dim": HIDDEN // HEADS // 2,  # GPT-J, CodeGen: rotary on half of each head (64 by default: past it)
    # multi-head latent attention (DeepSeek-V3-like): low-rank q/kv, a rotary part and a plain part of each head
    "q_lora_rank": HIDDEN // 2,
    "kv_lora_rank": HIDDEN // 2,
    "qk_rope_head_dim": HIDDEN // HEADS // 2,
    "qk_nope_head_dim": HIDDEN // HEADS // 2,
    "qk_head_dim": HIDDEN // HEADS,
    "v_head_dim": HIDDEN // HEADS,
    "n_group": 1,  # expert groups: the 4 experts in one
    "topk_group": 1,
    "vocab_size": VOCAB,
    "image_size": IMAGE,
    "embedding_size": HIDDEN,
}
# optional sizes whose None means "derived from the others" or "off" (not "missing"): left None
_DERIVED = {"head_dim", "n_inner", "intermediate_size", "num_key_value_heads", "rotary_dim", "q_lora_rank"}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id")


def _shrunk(config_class: type) -> dict:
    """The config arguments that make a small model: the size fields the class has (an optional one left None by
    default too: a mixture-of-experts' top-k is None in a config whose experts are on), token ids kept inside the
    small vocabulary, per-stage lists (hidden_sizes, depths, stage heads, their singular spellings) shortened to
    small values of the same length, sub-configs (`sub_configs`: a vision and a text tower, DBRX's attention and
    expert configs, BLT's four transformers; one typed AutoConfig as its default instance's class) shrunk the same
    way. Relations the model relies on are kept: multi-head
    latent attention (kv_lora_rank) expands its keys to every head, so its key/value heads are the heads (fewer would
    make transformers repeat them again when exported: 'broadcast a dimension of length 8'); a count of groups still
    divides the channels it divided; where the config's validation refuses the result, _consistent restores the
    relations it checks."""
    import dataclasses

    base: dict = {}
    try:
        default = config_class()
    except Exception:
        found = _features_off(config_class)
        if found is None:
            return {}
        base = found
        default = config_class(**base)
    fields = (
        {f.name for f in dataclasses.fields(config_class)}
        if dataclasses.is_dataclass(config_class)
        else set(vars(default))
    )
    aliases = getattr(config_class, "attribute_map", {})
    # an alias is set under its target's name, unless the target is no field of the class (Kimi-Linear declares
    # num_local_experts as a field and keeps it as num_experts): then the alias is the only way in
    real = {k for k in fields if k not in aliases or aliases[k] not in fields}
    fields |= set(aliases)
    optional_int = {
        f.name
        for f in (dataclasses.fields(config_class) if dataclasses.is_dataclass(config_class) else ())
        if f.default is None and re.search(r"\bint\b", str(f.type))
    }
    kw: dict = {}

    def value(k: str) -> object:
        try:
            return getattr(default, k, None)
        except Exception:  # a per-layer field read as one value (heterogeneous configs)
            return None

    def size(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for k, small_size in _SCALARS.items():
        if k in real and (size(value(k)) or (k in optional_int and value(k) is None and k not in _DERIVED)):
            kw[k] = small_size
    # fields in sorted order (a set's order changes from process to process): the same name every time
    for k in sorted(real):  # a vocabulary, a hidden size, heads under another name (BLT's hash vocabulary,
        v = value(k)  # a linear attention's own heads beside the softmax attention's: linear_num_heads)
        if k in kw or not size(v):
            continue
        if re.search(r"(^|_)vocab(_|$)", k) and v > VOCAB:  # only ever smaller: type_vocab_size stays 2
            kw[k] = VOCAB
        elif re.search(r"(^|_)hidden_size(_|$)", k) and v > HIDDEN:
            kw[k] = HIDDEN
        elif re.search(r"^(\w+_)?num_(\w+_)?heads$", k) and v > HEADS:
            kw[k] = HEADS
        elif re.search(r"^\w+_head_dim$", k) and v > HIDDEN // HEADS:
            kw[k] = HIDDEN // HEADS
    for k in _TOKEN_IDS:
        token = value(k)
        if k in real and isinstance(token, int) and token >= VOCAB:
            kw[k] = _TOKEN_IDS.index(k) % 3
    if "num_key_value_heads" in kw and "kv_lora_rank" in real:
        kw["num_key_value_heads"] = kw.get("num_attention_heads", HEADS)
    if "kv_lora_rank" in real and "qk_rope_head_dim" in kw and value("head_dim") == value("qk_rope_head_dim"):
        _rotary_head_dim(config_class, kw)
    # (CvT's `depth` is left as it is: its code indexes stage i's drop-path rates, depth[i] of them, by i)
    for k in ("hidden_sizes", "depths", "num_heads", "num_attention_heads", "embed_dims", "embed_dim"):
        stages = value(k)
        if k in real and isinstance(stages, (list, tuple)) and stages and all(isinstance(x, int) for x in stages):
            n = len(stages)
            kw[k] = {
                "hidden_sizes": [16 * 2**i for i in range(n)],
                "embed_dims": [16 * 2**i for i in range(n)],
                "embed_dim": [16 * 2**i for i in range(n)],
                "depths": [1] * n,
                "num_heads": [2**i for i in range(n)],
                "num_attention_heads": [2**i for i in range(n)],  # PVT's per stage: [1, 2, 5, 8] split 64 unevenly
            }[k]
            if k == "num_heads" and isinstance(kw.get("embed_dim"), int):
                kw["embed_dim"] = 16  # stage i has embed_dim · 2^i channels and 2^i heads
    _layout_sixths(config_class, kw, real, value)
    _hidden_size_split(kw, real, value)
    _stage_channels(kw, real, value)
    _keep_groups(kw, real, value)
    for k, sub in (getattr(config_class, "sub_configs", None) or {}).items():
        if k not in real or not isinstance(sub, type):
            continue
        small = _shrunk(sub)
        inner = value(k)
        model_type = getattr(inner, "model_type", None)
        if not small and isinstance(model_type, str):
            # a sub-config typed AutoConfig (Fuyu's text model, Gemma 3's vision tower): its class is the default
            # instance's, named by model_type in the dict so the parent resolves the same class
            small = _shrunk(type(inner))
            if small:
                small = {"model_type": model_type, **small}
        if small:
            kw[k] = small
    for k, v in base.items():  # the values the config's validation demands win over the small sizes
        kw[k] = {**kw[k], **v} if isinstance(v, dict) and isinstance(kw.get(k), dict) else v
    return _consistent(config_class, kw, default, real, value)


def _features_off(config_class: type) -> dict | None:
    """Arguments that make a config whose own default is refused valid, by turning features off one at a time (a
    flag True → False, a size → 0, in a sub-config's default), keeping each change after which the validation
    fails at a later line of the config's module or not at all: its checks run in order, so a later failure means
    the earlier check now holds. Gemma 4's assistant checks that its text config's per-layer inputs are off, while
    the text config's defaults have them on. None: no such changes found."""
    import inspect
    import traceback

    try:
        source = inspect.getfile(config_class)
    except (TypeError, OSError):
        return None

    def failing_line(kw: dict) -> int | None:  # None: accepted; -1: failed outside the config's module
        try:
            config_class(**kw)
        except Exception as e:
            lines, seen = [-1], set()
            error: BaseException | None = e
            while error is not None and id(error) not in seen:
                seen.add(id(error))
                lines += [n for f, n in traceback.walk_tb(error.__traceback__) if f.f_code.co_filename == source]
                error = error.__cause__ or error.__context__
            return max(lines)
        return None

    candidates: list[tuple[str, dict]] = []  # (sub-config, the change)
    for k in sorted(getattr(config_class, "sub_configs", None) or {}):
        inner = _default_sub_config(config_class, k)
        model_type = getattr(inner, "model_type", None)
        tag = {"model_type": model_type} if isinstance(model_type, str) else {}
        for f, v in sorted(vars(inner).items() if inner is not None else ()):
            if not f.startswith("_") and (v is True or (type(v) is int and v > 0)):
                candidates.append((k, {**tag, f: False if v is True else 0}))
    kw: dict = {}
    line = failing_line(kw)
    while line is not None:
        for k, change in candidates:
            trial = {**kw, k: {**kw.get(k, {}), **change}}
            after = failing_line(trial)
            if after is None or after > line:
                kw, line = trial, after
                break
        else:
            return None
    return kw or None


def _default_sub_config(config_class: type, key: str) -> object | None:
    """A sub-config's default instance, built alone (its parent's default may be what is refused): its class, or
    for one typed AutoConfig the model type its spec (sub_configs_defaults) names."""
    spec = (getattr(config_class, "sub_configs_defaults", None) or {}).get(key)
    cls = (getattr(config_class, "sub_configs", None) or {}).get(key)
    try:
        model_type = getattr(spec, "model_type", None)
        if isinstance(model_type, str):
            import transformers

            return transformers.CONFIG_MAPPING[model_type]()
        return cls() if isinstance(cls, type) else None
    except Exception:
        return None


# layer counts, in the order _shrunk looks for them
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")


def _consistent(config_class: type, kw: dict, default: object, real: set, value) -> dict:
    """The shrunk arguments as the config's own validation accepts them. Sizes set one by one can break a relation
    the config checks (or a property the model reads checks): key/value heads that must equal the heads, values
    given per layer for the old number of layers, counts of layers past the new number, a size that must equal the
    hidden size. Where the config refuses the arguments, the fewest of those relations are restored (each one a
    change made consistently, never a value read from the error message); a config that accepts them as they are is
    left exactly as it was. None helping: the arguments as they were (the build then reports the config's error)."""
    import itertools

    if not kw or not _refuses(config_class, kw, default):
        return kw
    fixes = [_no_gqa, _per_layer_values, _layer_counts, _hidden_size_copies, _head_width]
    for n in range(1, len(fixes) + 1):
        for chosen in itertools.combinations(fixes, n):
            fixed = dict(kw)
            for fix in chosen:
                fix(fixed, real, value)
            if fixed != kw and not _refuses(config_class, fixed, default):
                return fixed
    return kw


def _refuses(config_class: type, kw: dict, default: object) -> bool:
    """The config class raises on these arguments, or on reading a property that its default config can read
    (Gemma 3n's kv_sharing_modes checks the layer types against the shared layers only when read)."""
    try:
        config = config_class(**kw)
        for name in dir(config_class):
            if not isinstance(getattr(config_class, name, None), property):
                continue
            try:
                getattr(default, name)
            except Exception:
                continue  # not readable on the default config either: not a relation the model relies on
            getattr(config, name)
    except Exception:
        return True
    return False


def _no_gqa(kw: dict, real: set, value) -> None:
    """As many key/value heads as heads: a model without grouped-query attention (ESMC) refuses fewer."""
    if "num_key_value_heads" in kw and "num_attention_heads" in kw:
        kw["num_key_value_heads"] = kw["num_attention_heads"]


def _hidden_key(kw: dict) -> str | None:
    """The field of kw that holds the model's hidden size, under the names configs give it."""
    return next((k for k in ("hidden_size", "d_model", "n_embd", "dim") if k in kw), None)


def _head_width(kw: dict, real: set, value) -> None:
    """The heads' total width as the same multiple of the hidden size as by default: Mamba-2's heads split its
    inner width, hidden_size × expand (checked: hidden_size * expand must equal num_heads * head_dim), so 4 heads
    of 64 channels over 2 × 64 take head_dim 32."""
    hidden = _hidden_key(kw)
    heads = next((k for k in ("num_heads", "num_attention_heads", "n_head", "n_heads") if k in kw), None)
    if hidden is None or heads is None or "head_dim" not in kw:
        return
    old_hidden, old_heads, old_head_dim = value(hidden), value(heads), value("head_dim")
    if not all(isinstance(x, int) and x > 0 for x in (old_hidden, old_heads, old_head_dim)):
        return
    width = old_heads * old_head_dim * kw[hidden]  # the new total width, times old_hidden
    if width % (old_hidden * kw[heads]) == 0:
        kw["head_dim"] = width // (old_hidden * kw[heads])


def _layer_count(kw: dict, value) -> tuple[int, int] | None:
    """(old, new) number of layers, where the shrinker lowered it."""
    for k in _LAYER_COUNTS:
        old = value(k)
        if k in kw and isinstance(old, int) and old > kw[k]:
            return old, kw[k]
    return None


def _per_layer_values(kw: dict, real: set, value) -> None:
    """Values given per layer for the old number of layers, cut to the new one keeping each kind of layer the
    default had (layer types [sliding × 4, full, ...] → [sliding, full]); a size given per layer takes the small
    size; a run-length list of layer patterns ([[['global', 'local'], 12]]) keeps each pattern once, the number of
    layers then the patterns' total."""
    counts = _layer_count(kw, value)
    if counts is None:
        return
    old, new = counts
    for k in sorted(real):
        v = value(k)
        if k in _LAYER_COUNTS or not isinstance(v, (list, tuple)) or not v:
            continue
        if len(v) == old and k in _SCALARS and all(isinstance(x, int) for x in v):
            kw[k] = [_SCALARS[k]] * new
        elif len(v) == old and all(isinstance(x, (str, int, float)) for x in v):
            picked = sorted({x: i for i, x in reversed(list(enumerate(v)))}.values())[:new]  # each kind's first
            picked += [i for i in range(old) if i not in picked][: new - len(picked)]
            kw[k] = [v[i] for i in sorted(picked)]
        elif (
            all(
                isinstance(p, (list, tuple))
                and len(p) == 2
                and isinstance(p[0], (list, tuple))
                and isinstance(p[1], int)
                for p in v
            )
            and sum(len(p[0]) * p[1] for p in v) == old
        ):
            kw[k] = [[list(p[0]), 1] for p in v]
            total = sum(len(p[0]) for p in v)
            for c in _LAYER_COUNTS:
                if c in kw:
                    kw[c] = total


def _layer_counts(kw: dict, real: set, value) -> None:
    """Counts of some of the layers (shared, dense, per stack) scaled as the number of layers was."""
    counts = _layer_count(kw, value)
    if counts is None:
        return
    old, new = counts
    for k in sorted(real):
        v = value(k)
        if k in kw or k in _LAYER_COUNTS or not re.fullmatch(r"(num|n)_\w*layers", k):
            continue
        if isinstance(v, int) and not isinstance(v, bool) and 0 < v < old:
            kw[k] = v * new // old


def _hidden_size_copies(kw: dict, real: set, value) -> None:
    """A size or dimension that had a hidden size's default value is that hidden size: the config's own (an
    adapter's input) or, in a config of several models, another's (a vision adapter's output is the text model's
    hidden size)."""
    parts = [(kw, real, value)]  # (the shrunk arguments, the fields, their default values): the config's own ...
    for k in sorted(real):  # ... and each sub-config's
        inner = value(k)
        if isinstance(kw.get(k), dict) and inner is not None:
            fields = {f for f in vars(inner) if not f.startswith("_")}
            parts.append((kw[k], fields, lambda f, inner=inner: _read(inner, f)))
    sizes: dict[int, int] = {}  # a hidden size's default → its shrunk value
    for small, _, get in parts:
        key = next((k for k in ("hidden_size", "d_model", "n_embd", "dim", "embed_dim") if k in small), None)
        if key and isinstance(get(key), int) and isinstance(small[key], int):
            sizes.setdefault(get(key), small[key])
    for small, fields, get in parts:
        for k in sorted(fields):
            v = get(k)
            if k not in small and re.search(r"(size|dim)", k) and type(v) is int and v in sizes:
                small[k] = sizes[v]


def _hidden_size_split(kw: dict, real: set, value) -> None:
    """A list of sizes that sums to the hidden size (Reformer's axial position embeddings: (64, 192) of 256
    channels, concatenated) is split the same way at the shrunk hidden size: the model refuses parts that no longer
    sum to it. Left as it is where the parts do not scale to whole numbers."""
    key = _hidden_key(kw)
    old = value(key) if key else None
    if not key or not isinstance(old, int) or not isinstance(kw[key], int) or old <= 0:
        return
    new = kw[key]
    for k in sorted(real):
        parts = value(k)
        if k in kw or not isinstance(parts, (list, tuple)) or len(parts) < 2:
            continue
        if not all(type(x) is int and x > 0 for x in parts) or sum(parts) != old:
            continue
        if all(x * new % old == 0 for x in parts):
            kw[k] = type(parts)(x * new // old for x in parts)


def _read(config: object, field: str) -> object:
    try:
        return getattr(config, field, None)
    except Exception:  # a per-layer field read as one value (heterogeneous configs)
        return None


# Models whose code (not their config) concatenates six 2-D layout embeddings of hidden_size // 6 channels each
# (x0, y0, x1, y1, height, width) into a hidden-size input: LiLT's LiltLayoutEmbeddings. No field states it, so
# the relation is named here; a hidden size that is no multiple of 6 gives 60 channels where 64 are read.
_SIX_LAYOUT_EMBEDDINGS = {"lilt"}
LAYOUT_HIDDEN = 48  # a multiple of 6 (six layout embeddings) and of HEADS × 4 (LiLT's layout heads are a 4th)


def _layout_sixths(config_class: type, kw: dict, real: set, value) -> None:
    """Six 2-D layout embeddings concatenated into the hidden size (configs with 2-D positions): LayoutLMv3's four
    of coordinate_size and two of shape_size made up the default hidden size, and LiLT's are a sixth of it each
    (_SIX_LAYOUT_EMBEDDINGS): the hidden size is LAYOUT_HIDDEN, divided by six, and the given sizes keep their
    share."""
    if "max_2d_position_embeddings" not in real or "hidden_size" not in kw:
        return
    hidden, coordinate, shape = value("hidden_size"), value("coordinate_size"), value("shape_size")
    sized = isinstance(coordinate, int) and isinstance(shape, int) and 4 * coordinate + 2 * shape == hidden
    if not sized and getattr(config_class, "model_type", None) not in _SIX_LAYOUT_EMBEDDINGS:
        return
    kw["hidden_size"] = LAYOUT_HIDDEN
    if sized:
        kw["coordinate_size"] = coordinate * LAYOUT_HIDDEN // hidden
        kw["shape_size"] = (LAYOUT_HIDDEN - 4 * kw["coordinate_size"]) // 2


def _rotary_head_dim(config_class: type, kw: dict) -> None:
    """Multi-head latent attention whose head_dim is by default its rotary part's size is given that size when the
    config keeps head_dim as given (LongCat-Flash sizes its rotary embedding by head_dim: 8 sin/cos against a rotary
    part of 4 pairs fails to broadcast); configs that derive it themselves (DeepSeek-V2 and V3) are left alone."""
    if "head_dim" not in kw or kw["head_dim"] == kw["qk_rope_head_dim"]:
        return
    try:
        kept = config_class(**kw).head_dim == kw["head_dim"]
    except Exception:
        return
    if kept:
        kw["head_dim"] = kw["qk_rope_head_dim"]


def _stage_channels(kw: dict, real: set, value) -> None:
    """Channel counts given per stage beside hidden_sizes (HGNet-V2's stem_channels, stage_in/mid/out_channels:
    the backbone is built from these, the classifier from hidden_sizes[-1]) shrink by the factor hidden_sizes did,
    one factor for all so that counts that were equal (a stage's output, the next stage's input) stay equal; the
    image's channel count (a stem's first entry) stays."""
    old, new = value("hidden_sizes"), kw.get("hidden_sizes")
    if not isinstance(old, (list, tuple)) or not isinstance(new, list) or not old or not new or not old[-1]:
        return
    ratio = new[-1] / old[-1]
    image = value("num_channels") if isinstance(value("num_channels"), int) else 3
    for k in sorted(real):
        v = value(k)
        if k in kw or "channels" not in k or not isinstance(v, (list, tuple)) or not v:
            continue
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            kw[k] = [x if x <= image else max(1, int(x * ratio)) for x in v]


def _keep_groups(kw: dict, real: set, value) -> None:
    """A count of groups (GroupNorm's num_groups, grouped convolutions) that divided every channel size the config
    had keeps dividing the shrunk ones: scaled down as they were (a block's inner width is a fixed fraction of its
    stage's), then lowered until it divides them all."""
    channels = [k for k in kw if k in ("hidden_size", "embedding_size", "hidden_sizes", "embed_dims", "embed_dim")]

    def sizes(get) -> list[int]:
        out: list[int] = []
        for k in channels:
            v = get(k)
            out += [x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, int)]
        return out

    old, new = sizes(value), sizes(kw.get)
    if not old or len(old) != len(new):
        return
    ratio = min(n / o for n, o in zip(new, old))
    for k in sorted(real):
        g = value(k)
        if "group" not in k or not isinstance(g, int) or isinstance(g, bool) or g <= 1 or k in kw:
            continue
        if any(o % g for o in old):
            continue  # not a count the channels are split by
        small = max(1, int(g * min(ratio, 1.0)))
        while small > 1 and any(n % small for n in new):
            small -= 1
        if small != g:
            kw[k] = small


def _literal(kw: dict) -> str:
    return ",".join(f"{k}={v!r}".replace(" ", "") for k, v in kw.items())


def _masking_tokens(kw: dict, config_class: type) -> None:
    """A masked language model reads its mask token's id (ESM blanks those embeddings) and its padding id (and
    numbers the positions past the padding): a config that declares a mask token but leaves it None, as ESM's does
    with its padding id too, cannot run its forward; both get ids inside the small vocabulary."""
    try:
        default = config_class()
    except Exception:
        return
    if not hasattr(default, "mask_token_id") or default.mask_token_id is not None:
        return
    for k, token in (("pad_token_id", 1), ("mask_token_id", 2)):
        if hasattr(default, k) and getattr(default, k) is None:
            kw.setdefault(k, token)


def _ordinary_values(config_class: type, auto_name: str, kw: dict) -> None:
    """Values a user gives a config whose model does not build without them, where transformers' own default
    config does not build either: a head size the config leaves None and the model raises to a power (Hunyuan:
    head_dim ** -0.5), layer types left None that the model indexes per layer (LFM2-MoE), rotary parameters keyed
    by layer type with a type missing (Cohere Compass). Each is filled only where the model, built on the meta
    device, fails without it and builds with it; a model that builds is left exactly as shrunk. (DBRX is left
    refused as transformers' failure: given the attn_config.rope_theta its code reads, it builds but cannot run,
    clamping its q/k/v to clip_qkv=None.)"""
    try:
        config = config_class(**kw)
    except Exception:
        return
    fills: list[dict] = []
    hidden, heads = _read(config, "hidden_size"), _read(config, "num_attention_heads")
    if (
        _read(config, "head_dim") is None
        and "head_dim" in vars(config)
        and isinstance(hidden, int)
        and isinstance(heads, int)
        and heads > 0
        and hidden % heads == 0
    ):
        fills.append({"head_dim": hidden // heads})
    layers = next((getattr(config, k) for k in _LAYER_COUNTS if isinstance(getattr(config, k, None), int)), None)
    types = _read(config, "layer_types")
    if types is None and "layer_types" in vars(config) and layers:
        types = ["full_attention"] * layers  # transformers' ordinary layer
        fills.append({"layer_types": types})
    rope = _read(config, "rope_parameters")
    if isinstance(rope, dict) and "rope_type" not in rope and isinstance(types, list) and set(types) - set(rope):
        theta = float(getattr(config_class, "default_theta", 10_000.0))
        missing = {t: {"rope_type": "default", "rope_theta": theta} for t in sorted(set(types) - set(rope))}
        fills.append({"rope_parameters": {**rope, **missing}})
    # a count the config leaves None (annotated int | None) that the model computes with: Dots1 multiplies
    # moe_intermediate_size by n_shared_experts, None by default; 1, the smallest count, where nothing else builds
    counts = [
        {f.name: 1}
        for f in (dataclasses.fields(config_class) if dataclasses.is_dataclass(config_class) else ())
        if f.default is None
        and re.search(r"\bint\b", str(f.type))
        and f.name not in kw
        and f.name not in _TOKEN_IDS
        and _read(config, f.name) is None
    ]
    if not (fills or counts) or _builds(config_class, auto_name, kw):
        return
    for fill in [*fills, {k: v for f in fills for k, v in f.items()}, *counts]:
        if _builds(config_class, auto_name, {**kw, **fill}):
            kw.update(fill)
            return


def _builds(config_class: type, auto_name: str, kw: dict) -> bool:
    return _built_on_meta(config_class, auto_name, kw) is not None


def _built_on_meta(config_class: type, auto_name: str, kw: dict) -> object | None:
    """What the Auto class builds from these arguments on the meta device; None if it does not build."""
    import torch
    import transformers

    try:
        config = config_class(**kw)
        with torch.device("meta"):
            return getattr(transformers, auto_name).from_config(config)
    except Exception:
        return None


HF_SIZES = (64, 96, 128, 160, 224)  # image sizes tried in order where a model does not run at IMAGE


def _image_size_that_runs(config_class: type, auto_name: str, kw: dict) -> None:
    """An image model that does not run at the small image size gets the first of HF_SIZES it runs at, built and
    run on the meta device (nothing is allocated): MobileViTv2's last stage unfolds 2 × 2 patches of a map that a
    32 × 32 image has made 1 × 1 ('calculated shape of the array of sliding blocks as (0, 0)'). Where the config
    has an integer window_size, smaller windows (4, 2) are tried at each size before the next size: Swin's windows
    of 7 run only where every stage's map is a multiple of 7 (224), windows of 2 at 64, at an eighth of the
    tokens. A model that runs at IMAGE, or at none of them (a model the meta device cannot run), is left as it
    was."""
    import torch

    if kw.get("image_size") != IMAGE:
        return

    def runs(trial: dict) -> bool:
        model = _built_on_meta(config_class, auto_name, trial)
        channels = getattr(getattr(model, "config", None), "num_channels", 3)
        size = trial["image_size"]
        try:  # in eval mode at batch 2: a BatchNorm on a 1 × 1 map refuses one example in train mode
            with torch.no_grad():
                model.eval()(pixel_values=torch.empty(2, channels, size, size, device="meta"))  # type: ignore[attr-defined]
        except Exception:
            return False
        return True

    windows: list[dict] = [{}]
    with contextlib.suppress(Exception):  # a config that does not build as shrunk keeps its window
        own = getattr(config_class(**kw), "window_size", None)
        if isinstance(own, int) and not isinstance(own, bool):
            windows += [{"window_size": w} for w in (4, 2) if w < own]
    for size in (IMAGE, *HF_SIZES):
        for window in windows:
            trial = {**kw, "image_size": size, **window}
            if runs(trial):
                kw.update(trial)
                return


_MORE_LAYERS = 8  # the most layers a shrunk model gets to keep every kind of layer its architecture has


def _layer_kinds_kept(config_class: type, auto_name: str, kw: dict) -> None:
    """A hybrid model keeps every kind of layer: with 2 layers, Jamba (attention at layer 4 of every 8) and Kimi
    Linear (full attention every 4th layer) lose their attention layers, so a sweep would grow a pure state-space
    or linear-attention model under their name. The model is built on the meta device with 2 layers and with 8;
    where the 8-layer model has module classes the 2-layer one lacks, the layer count becomes the smallest that has
    them all. Read from the built models only: no field names, no layer patterns."""
    # the layer count at the top, or in a sub-config (Qwen 3.5's text_config)
    places = [(kw, k) for k in _LAYER_COUNTS if isinstance(kw.get(k), int)][:1] or [
        (sub, k) for sub in kw.values() if isinstance(sub, dict) for k in _LAYER_COUNTS if isinstance(sub.get(k), int)
    ][:1]
    if not places:
        return
    holder, key = places[0]
    layers = holder[key]

    def classes_at(n: int) -> set[str] | None:
        holder[key] = n
        try:
            return _module_classes(config_class, auto_name, kw)
        finally:
            holder[key] = layers

    few, many = classes_at(layers), classes_at(_MORE_LAYERS)
    if few is None or many is None or many <= few:
        return
    for n in range(layers + 1, _MORE_LAYERS + 1):
        classes = classes_at(n)
        if classes is not None and many <= classes:
            holder[key] = n
            return


def _module_classes(config_class: type, auto_name: str, kw: dict) -> set[str] | None:
    """The class names of every module of the model these arguments build (on the meta device); None if it does
    not build."""
    model = _built_on_meta(config_class, auto_name, kw)
    return None if model is None else {type(m).__name__ for m in model.modules()}  # type: ignore[attr-defined]


def hf_task(model_type: str) -> tuple[str, str] | None:
    """The task the sweep gives a model type (the first of HF_TASKS with a head for it) and its model class's
    name; None when it has none of them."""
    from transformers.models.auto import modeling_auto

    for task, mapping in HF_TASKS:
        names = getattr(modeling_auto, mapping)
        if model_type in names:
            return task, names[model_type]
    return None


def hf_models() -> list[Model]:
    import transformers
    from transformers.models.auto import configuration_auto

    out = []
    for model_type in sorted(configuration_auto.CONFIG_MAPPING_NAMES):
        found = hf_task(model_type)
        if found is None:
            continue
        task = found[0]
        try:
            config_class = transformers.CONFIG_MAPPING[model_type]
        except Exception:
            continue
        kw = _shrunk(config_class)
        _ordinary_values(config_class, _AUTO[task], kw)
        _layer_kinds_kept(config_class, _AUTO[task], kw)
        if task == "image-classification":
            _image_size_that_runs(config_class, _AUTO[task], kw)
        if task == "masked-lm":
            _masking_tokens(kw, config_class)
        args = f"({_literal(kw)})" if kw else ""
        out.append(Model("hf", model_type, f"hf:{model_type}/{task}{args}"))
    return out


def smoke_models() -> list[Model]:
    """The fixed subset `make test` sweeps (tests/test_sweep.py): tiny models of tests/factories.py."""
    return [
        Model("smoke", "small_cnn", "tests.factories:small_cnn", ("--input-shape", "1,3,16,16")),
        Model("smoke", "token_classifier", "tests.factories:token_classifier", ("--input", "input_ids:int64[1,16]")),
    ]


REGISTRIES = {"torchvision": torchvision_models, "timm": timm_models, "hf": hf_models, "smoke": smoke_models}
