"""A Hugging Face folder in bfloat16 through `graphgrow mutate FOLDER --pass … -o OUT` and back with `from_pretrained`
(issue 40's measurement): the time and peak resident memory of the CLI's run, then the original and the grown folder
loaded as their class and compared on one batch (logits) and greedy generation.

    python benchmarks/hf_roundtrip.py --size 1b [--pass "deepen(block=copy)"] [--cli-args "--max-params N"] [--keep DIR]

Random weights (nothing downloaded), a LLaMA of TinyLlama's shape at `1b` (hidden 2048, 22 layers, 32 heads, 4
key/value heads, MLP 5632, vocabulary 32,000: 1.10 B parameters, 2.2 GB in bfloat16), written with save_pretrained.
The peak memory is the CLI process's own (getrusage of the finished child), so building and comparing the models here
does not count.
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SIZES = {  # name → (hidden, layers, heads, key/value heads, MLP, vocabulary)
    "tiny": (64, 2, 4, 2, 128, 256),
    "1b": (2048, 22, 32, 4, 5632, 32000),
}


def build_folder(size: str, where: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, mlp, vocab = SIZES[size]
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=mlp,
        vocab_size=vocab,
        max_position_embeddings=256,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16: no float32 copy of a model this size here
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(where)
    del model


def compare(original: Path, grown: Path, tokens: int = 16, new: int = 8) -> dict:
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(original, dtype=torch.bfloat16).eval()
    b = AutoModelForCausalLM.from_pretrained(grown, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, a.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        la, lb = a(ids).logits.float(), b(ids).logits.float()
        ga = a.generate(ids[:1], max_new_tokens=new, do_sample=False)
        gb = b.generate(ids[:1], max_new_tokens=new, do_sample=False)
    return {
        "grown_class": type(b).__name__,
        "layers": [a.config.num_hidden_layers, b.config.num_hidden_layers],
        "hidden": [a.config.hidden_size, b.config.hidden_size],
        "params": [sum(p.numel() for p in m.parameters()) for m in (a, b)],
        "logits_max_abs_diff": float((la - lb).abs().max()),
        "logits_scale": float(la.abs().max()),
        "same_greedy_tokens": bool(torch.equal(ga, gb)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--pass", dest="spec", default="deepen(block=copy)")
    parser.add_argument("--cli-args", default="", help="more graphgrow mutate flags, e.g. '--max-params 200000000'")
    parser.add_argument("--keep", type=Path, help="build the folders here (kept) instead of a temporary folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        original, grown = root / "original", root / "grown"
        t = time.perf_counter()
        build_folder(args.size, original)
        built = time.perf_counter() - t
        graphgrow = [
            sys.executable,
            "-m",
            "graphgrow.cli",
            "mutate",
            str(original),
            "--pass",
            args.spec,
            *shlex.split(args.cli_args),
        ]
        t = time.perf_counter()
        proc = subprocess.run([*graphgrow, "-o", str(grown)], capture_output=True, text=True)
        cli_s = time.perf_counter() - t
        peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # kB on Linux
        if proc.returncode != 0:
            raise SystemExit(f"graphgrow exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        row = {
            "size": args.size,
            "pass": args.spec,
            "folder_bytes": sum(f.stat().st_size for f in original.glob("*.safetensors")),
            "build_s": round(built, 1),
            "cli_s": round(cli_s, 1),
            "cli_peak_rss_mib": round(peak_mib),
            **compare(original, grown),
        }
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
