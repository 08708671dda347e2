"""Issue 40's Done-when matrix: Hugging Face families × growth passes × dtypes, each a folder round trip.

    python benchmarks/native_matrix.py [--family llama,gpt2] [--pass grow_hidden] [--dtype bfloat16] [--markdown]

Per cell: a tiny model of the family (hidden 32, 2 layers, vocabulary 100; random weights, nothing downloaded) is
saved with save_pretrained in the dtype, grown as `graphgrow mutate FOLDER --pass ... -o OUT` grows it, in process and
with one capture per family and dtype (family_cells), loaded back with from_pretrained in the
dtype and compared with the original loaded the same way: logits on a batch with a padded row (decoders left-padded,
encoders right-padded; masked positions left out), and for decoders greedy generate() with the KV cache (same
tokens). A cell reads:
- `exact`: the logits are bit-equal (bfloat16) or within 1e-5 of the largest (float32), and the tokens the same;
- `close <d>`: logits differ by d relative to the largest, within the dtype's rounding (one bfloat16 ulp, 2^-7),
  tokens the same — the growth stored a value the dtype rounds (grow_hidden by a size that is not a multiple, the
  norm's rescaled weights);
- `refused`: graphgrow said why (the reason is printed), nothing written;
- `FAIL`: anything else (an error, a difference beyond the dtype's rounding, other tokens).
The families and passes are the ones tests/test_native_families.py runs a cheap subset of.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

H, LAYERS, HEADS, VOCAB = 32, 2, 4, 100


@dataclass
class Family:
    config: str  # transformers config class
    model: str  # transformers model class
    kind: str  # "decoder", "encoder" or "image"
    sizes: dict[str, Any] = field(default_factory=dict)  # the config's own names for the sizes

    def build(self, dtype: torch.dtype, seed: int = 0):
        import transformers

        config = getattr(transformers, self.config)(**self.sizes)
        if hasattr(config, "use_cache"):
            config.use_cache = False
        torch.manual_seed(seed)
        model = getattr(transformers, self.model)(config).eval()
        with torch.no_grad():  # trained-looking norms: a γ of ones would hide a rescaled γ's rounding
            for name, p in model.named_parameters():
                if p.dim() == 1 and "norm" in name.lower() and name.endswith("weight"):
                    p.copy_(1 + 0.2 * torch.randn_like(p))
        return model.to(dtype)


_STD = {"hidden_size": H, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "vocab_size": VOCAB}
_GQA = {**_STD, "num_key_value_heads": 2, "intermediate_size": 64}
_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", "decoder", {**_GQA, **_TOKENS}),
    "mistral": Family("MistralConfig", "MistralForCausalLM", "decoder", {**_GQA, **_TOKENS}),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", "decoder", {**_GQA, **_TOKENS}),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", "decoder", {**_GQA, **_TOKENS, "head_dim": 8}),
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", "decoder", {**_GQA, **_TOKENS, "head_dim": 8}),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", "decoder", {**_GQA, **_TOKENS}),
    "olmo": Family("OlmoConfig", "OlmoForCausalLM", "decoder", {**_GQA, **_TOKENS}),
    "granite": Family("GraniteConfig", "GraniteForCausalLM", "decoder", {**_GQA, **_TOKENS}),
    "gpt_neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", "decoder", {**_STD, **_TOKENS, "intermediate_size": 64}),
    "opt": Family(
        "OPTConfig",
        "OPTForCausalLM",
        "decoder",
        {**_STD, **_TOKENS, "ffn_dim": 64, "word_embed_proj_dim": H, "max_position_embeddings": 64},
    ),
    "gpt2": Family(
        "GPT2Config",
        "GPT2LMHeadModel",
        "decoder",
        {"n_embd": H, "n_layer": LAYERS, "n_head": HEADS, "vocab_size": VOCAB, "n_positions": 64, **_TOKENS},
    ),
    "bert": Family("BertConfig", "BertForMaskedLM", "encoder", {**_STD, "intermediate_size": 64, "pad_token_id": 0}),
    "roberta": Family(
        "RobertaConfig", "RobertaForMaskedLM", "encoder", {**_STD, "intermediate_size": 64, "pad_token_id": 1}
    ),
    "electra": Family(
        "ElectraConfig",
        "ElectraForMaskedLM",
        "encoder",
        {**_STD, "intermediate_size": 64, "embedding_size": H, "pad_token_id": 0},
    ),
    "distilbert": Family(
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        "encoder",
        {"dim": H, "n_layers": LAYERS, "n_heads": HEADS, "hidden_dim": 64, "vocab_size": VOCAB, "pad_token_id": 0},
    ),
    "vit": Family(
        "ViTConfig",
        "ViTForImageClassification",
        "image",
        {
            "hidden_size": H,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "intermediate_size": 64,
            "image_size": 32,
            "patch_size": 8,
            "num_labels": 5,
        },
    ),
}

PASSES = ("deepen", "grow_hidden", "grow_heads", "hidden+heads", "grow_width")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def mlp_targets(model) -> list[str]:
    """Every layer's MLP input Linear (outside the attention, the one with the most outputs in each numbered layer;
    GPT-2's Conv1D holds its weight in × out)."""
    best: dict[str, tuple[int, str]] = {}
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        layer = re.match(r"(.*\.\d+)\.", name)
        if layer is None or not isinstance(w, torch.Tensor) or w.dim() != 2 or "embed" in name or "att" in name:
            continue  # attention projections (q/k/v, GPT-NeoX's fused query_key_value) are not the MLP
        outs = w.shape[1] if type(m).__name__ == "Conv1D" else w.shape[0]
        if outs > best.get(layer.group(1), (0, ""))[0]:
            best[layer.group(1)] = (outs, name)
    return [name for _, name in best.values()]


def pass_specs(name: str, model) -> list[str]:
    if name == "deepen":
        return ["deepen(block=copy)"]
    if name == "grow_hidden":
        return [f"grow_hidden(by={H})"]  # a multiple of the size: replicated, exact in bfloat16 too
    if name == "grow_heads":
        return [f"grow_heads(heads={2 * HEADS})"]
    if name == "hidden+heads":  # together: classes that derive the head size as hidden size / heads (GPT-2, BERT)
        return [f"grow_hidden(by={H})", f"grow_heads(heads={2 * HEADS})"]
    return [f"grow_width(target={t})" for t in mlp_targets(model)]


def batch(fam: Family, seed: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    if fam.kind == "image":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}, None
    x = torch.randint(3, VOCAB, (2, 10), generator=g)
    mask = torch.ones_like(x)
    if fam.kind == "decoder":
        mask[0, :3] = 0  # left padding: generate() continues every row at its end
    else:
        mask[0, -3:] = 0
    return {"input_ids": x, "attention_mask": mask}, mask


def compare(fam: Family, a, b, dtype: torch.dtype) -> tuple[str, float]:
    """The cell's verdict (module docstring) and the logits' difference relative to their largest value."""
    inputs, mask = batch(fam)
    if fam.kind == "image":
        inputs = {k: v.to(dtype) for k, v in inputs.items()}
    with torch.no_grad():
        la, lb = a(**inputs).logits.float(), b(**inputs).logits.float()
    if mask is not None:
        la, lb = la[mask.bool()], lb[mask.bool()]
    rel = (la - lb).abs().max().item() / max(la.abs().max().item(), 1e-30)
    same = True
    if fam.kind == "decoder":
        a.generation_config.use_cache = b.generation_config.use_cache = True
        kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
        same = torch.equal(a.generate(**inputs, **kw), b.generate(**inputs, **kw))
    ulp = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    if same and (rel == 0.0 or (dtype == torch.float32 and rel <= 1e-5)):
        return "exact", rel
    if same and rel <= ulp:
        return f"close {rel:.1e}", rel
    return f"FAIL: logits {rel:.2e}{'' if same else ', other tokens'}", rel


def family_cells(family: str, dtype_name: str, passes: list[str], where: Path) -> dict[str, dict]:
    """Every pass of `passes` on one family in one dtype. The folder is opened once as `graphgrow mutate` opens it
    (jobs.opening.open_model: load, capture, trace check), then per pass: the pipeline (grow and verify), as_native
    as the CLI calls it (native_of), write_folder (save_pretrained plus the folder's other files), from_pretrained."""
    import transformers

    from graphgrow.core.errors import GraphgrowError, NotApplicable
    from graphgrow.io.hf_folder import write_folder
    from graphgrow.jobs.native import native_of
    from graphgrow.jobs.opening import open_model
    from graphgrow.jobs.pipeline import Pipeline

    fam, dtype = FAMILIES[family], DTYPES[dtype_name]
    src = where / f"{family}-{dtype_name}"
    fam.build(dtype).save_pretrained(src)
    cls = getattr(transformers, fam.model)
    original = cls.from_pretrained(src, dtype=dtype).eval()
    start = time.perf_counter()
    try:
        opened = open_model(str(src))
    except GraphgrowError as e:
        return {p: {"status": f"FAIL: {type(e).__name__}", "why": e.message, "seconds": 0.0} for p in passes}
    opening = time.perf_counter() - start
    out: dict[str, dict] = {}
    for pass_name in passes:
        start = time.perf_counter()
        try:
            grown = Pipeline.from_spec(pass_specs(pass_name, original)).run(opened.gm).gm
            folder = write_folder(
                native_of(grown, opened.loaded, lambda _: None), where / f"{src.name}-{pass_name}", src
            )
        except NotApplicable as e:
            out[pass_name] = {"status": "refused", "why": e.message, "seconds": time.perf_counter() - start}
            continue
        except GraphgrowError as e:
            out[pass_name] = {"status": f"FAIL: {type(e).__name__}", "why": e.message, "seconds": 0.0}
            continue
        seconds = time.perf_counter() - start + opening
        back = cls.from_pretrained(folder, dtype=dtype).eval()
        status, rel = compare(fam, original, back, dtype)
        out[pass_name] = {"status": status, "rel": rel, "seconds": seconds, "dtype": str(back.dtype)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default=",".join(FAMILIES))
    ap.add_argument("--pass", dest="passes", default=",".join(PASSES))
    ap.add_argument("--dtype", default=",".join(DTYPES))
    ap.add_argument("--markdown", action="store_true", help="print the table for docs/native.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows: dict[tuple[str, str], dict[str, str]] = {}
    reasons: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype_name in args.dtype.split(","):
            for family in args.family.split(","):
                passes = args.passes.split(",")
                try:
                    cells = family_cells(family, dtype_name, passes, Path(tmp))
                except Exception as e:  # noqa: BLE001 - a crash is the row's verdict
                    cells = {
                        p: {"status": f"FAIL: {type(e).__name__}", "why": str(e)[:200], "seconds": 0.0} for p in passes
                    }
                for pass_name, r in cells.items():
                    status = r["status"]
                    if "why" in r:
                        reasons[f"{family} {pass_name} {dtype_name}"] = " ".join(str(r["why"]).split())[:160]
                    rows.setdefault((family, dtype_name), {})[pass_name] = status
                    why = f"  ({reasons[f'{family} {pass_name} {dtype_name}']})" if "why" in r else ""
                    print(
                        f"{family:10} {dtype_name:8} {pass_name:12} {status:24} {r['seconds']:5.1f} s{why}", flush=True
                    )
    if args.markdown:
        passes = args.passes.split(",")
        print("\n| family | dtype | " + " | ".join(passes) + " |")
        print("|---|---|" + "---|" * len(passes))
        for (family, dtype_name), cells in rows.items():
            print(
                f"| {family} ({FAMILIES[family].kind}) | {dtype_name} | " + " | ".join(cells[p] for p in passes) + " |"
            )
        print()
        for k, why in reasons.items():
            print(f"- {k}: {why}")


if __name__ == "__main__":
    sys.exit(main())
