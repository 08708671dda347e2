"""Streaming growth of a checkpoint larger than graphgrow's in-memory budget (issue 42; docs/streaming.md): a LLaMA-
architecture Hugging Face folder in bfloat16 with random weights, written shard by shard (never held whole), grown by
`graphgrow mutate FOLDER --pass … -o OUT --max-memory 6G` (hidden ×1.25, heads to match, +4 copied layers), then
both folders loaded with `from_pretrained` and compared on one batch (logits, greedy tokens).

    python benchmarks/bench_stream.py --size 3b [--where /tmp/stream] [--keep]

Every stage runs in a child process of its own; its wall time and peak resident memory are that child's
(os.wait4's rusage), so nothing one stage holds counts for another. The folders go under --where and are removed at
the end unless --keep. The comparison loads each model whole in bfloat16 (one at a time): it needs memory for the
grown model, which the growth itself never does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

SECTION = "scale"
SIZES = {  # name → (hidden, layers, heads, MLP, vocabulary); key/value heads = heads
    "tiny": (64, 5, 4, 128, 300),
    "3b": (3200, 26, 32, 8640, 32000),  # OpenLLaMA 3B's shape: 3.43 B parameters, 6.9 GB in bfloat16
    "7b": (4096, 32, 32, 11008, 32000),  # LLaMA 7B's shape: 6.74 B parameters, 13.5 GB
}
SHARD_BYTES = 1 << 30


def growth_spec(size: str) -> list[str]:
    hidden, layers, heads, _, _ = SIZES[size]
    places = [layers * k // 5 - 1 for k in range(1, 5)]  # four copies spread along the stack
    return [
        f"grow_hidden(to={hidden * 5 // 4})",
        f"grow_heads(heads={heads * 5 // 4})",
        *(f"deepen(block=copy,after=model.layers.{i})" for i in places),
    ]


def write_checkpoint(size: str, folder: Path) -> None:
    """The folder save_pretrained would write, built tensor by tensor: names and shapes from the class on the meta
    device, values drawn per tensor (std 0.02, norms 1 ± 0.1), a shard written whenever 1 GiB is reached."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, mlp, vocab = SIZES[size]
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=mlp,
        vocab_size=vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",
    )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    written: list[list[str]] = []

    def flush() -> None:
        k = len(written)
        save_file(shards[0], str(folder / f"part-{k}.safetensors"), metadata={"format": "pt"})
        written.append(list(shards[0]))
        shards[0], sizes[0] = {}, 0

    for name, shape in shapes.items():
        norm = len(shape) == 1
        t = ((1.0 if norm else 0.0) + (0.1 if norm else 0.02) * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        if shards[0] and sizes[0] + 2 * t.numel() > SHARD_BYTES:
            flush()
        shards[0][name] = t
        sizes[0] += 2 * t.numel()
    flush()
    n, weight_map, total = len(written), {}, 0
    for k, names in enumerate(written):
        final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        os.rename(folder / f"part-{k}.safetensors", folder / final)
        weight_map.update(dict.fromkeys(names, final))
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def mergekit_config(size: str, original: Path) -> str:
    """mergekit's passthrough depth up-scaling of the same checkpoint at the same four places: layer i is repeated
    after itself (slices [0, i+1), [i, j+1), …), as deepen(block=copy) places its copies. Not function-preserving:
    mergekit copies a layer as it is, graphgrow zeroes the copy's output projections."""
    layers = SIZES[size][1]
    places = [layers * k // 5 - 1 for k in range(1, 5)]
    starts, ends = [0, *places], [p + 1 for p in places] + [layers]
    lines = ["slices:"]
    for a, b in zip(starts, ends):
        lines += ["  - sources:", f"      - model: {original}", f"        layer_range: [{a}, {b}]"]
    return "\n".join([*lines, "merge_method: passthrough", "dtype: bfloat16", ""])


def mergekit_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("mergekit") is not None


def run_depth_only(size: str, where: Path, result: dict, progress=print) -> None:
    """graphgrow doing what mergekit does (the four copies only, streamed), for a like-for-like row: wall time, peak
    RSS, and from_pretrained logits against the original's (a.pt must exist): a copy whose output projections are
    zero leaves them bit-equal."""
    original, deep = where / f"{size}-original", where / f"{size}-depth"
    if deep.exists():
        shutil.rmtree(deep)
    cli = [sys.executable, "-m", "graphgrow.cli", "mutate", str(original)]
    for spec in growth_spec(size)[2:]:
        cli += ["--pass", spec]
    progress("graphgrow mutate, depth only (streamed)")
    budget = "1M" if size == "tiny" else "6G"
    try:
        s, peak, _ = child([*cli, "-o", str(deep), "--max-memory", budget, "--json"])
        result["stages"]["graphgrow +4 layers (depth only, streamed, verified)"] = (s, peak)
        me = [sys.executable, str(Path(__file__).resolve())]
        child([*me, "--logits", str(deep), str(where / "d.pt")])
        a, d = torch.load(where / "a.pt"), torch.load(where / "d.pt")
        result["depth_only"] = {
            "params": d["params"],
            "logits_max_abs_diff": float((a["logits"] - d["logits"]).abs().max()),
            "same_greedy_tokens": bool(torch.equal(a["greedy"], d["greedy"])),
        }
    finally:
        shutil.rmtree(deep, ignore_errors=True)
        (where / "d.pt").unlink(missing_ok=True)


def run_mergekit(size: str, where: Path, result: dict, progress=print) -> None:
    """The side-by-side row of issue 42: mergekit (lazy unpickling, 1 GiB shards) on the checkpoint `run` wrote,
    its wall time and peak RSS, then its output's logits against the original's (a.pt must exist)."""
    original, merged = where / f"{size}-original", where / f"{size}-mergekit"
    if merged.exists():
        shutil.rmtree(merged)
    config = where / "mergekit.yml"
    config.write_text(mergekit_config(size, original))
    progress("mergekit passthrough (depth up-scaling)")
    cli = [sys.executable, "-m", "mergekit.scripts.run_yaml", str(config), str(merged)]
    s, peak, _ = child([*cli, "--lazy-unpickle", "--quiet", "--out-shard-size", "500M"])
    result["stages"]["mergekit passthrough +4 layers (depth only)"] = (s, peak)
    try:
        progress("from_pretrained: mergekit's output's logits")
        child([sys.executable, str(Path(__file__).resolve()), "--logits", str(merged), str(where / "m.pt")])
        a, m = torch.load(where / "a.pt"), torch.load(where / "m.pt")
        la, lm = a["logits"], m["logits"]
        result["mergekit"] = {
            "params": m["params"],
            "logits_rel_err": rel_err(lm, la),
            "same_argmax": float((la.argmax(-1) == lm.argmax(-1)).float().mean()),
        }
    finally:
        shutil.rmtree(merged, ignore_errors=True)
        (where / "m.pt").unlink(missing_ok=True)


def logits_of(folder: Path, out: Path, dtype: str = "bfloat16") -> None:
    """from_pretrained (in `dtype`), the logits of one seeded batch and 8 greedy tokens, saved to `out`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits.float()
        greedy = model.generate(ids[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
    params = sum(p.numel() for p in model.parameters())
    torch.save({"logits": logits, "greedy": greedy, "params": params, "class": type(model).__name__}, out)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖: `a`'s distance from the reference `b`."""
    return float((a - b).norm() / b.norm())


def _partial(where: Path, result: dict) -> None:
    """The stages measured so far (a long run stopped part-way still says what it measured)."""
    (where / f"{result['size']}-partial.json").write_text(json.dumps(result, indent=1, default=str))


def child(args: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in GiB, stdout) of one child process; its stderr is passed through."""
    t = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args[:4])}… exited {proc.returncode}")
    return time.perf_counter() - t, usage.ru_maxrss / 2**20, out  # ru_maxrss: kB on Linux


def run(size: str, where: Path, keep: bool = False, progress=print, reuse: bool = False) -> dict:
    """`reuse`: a checkpoint a previous run kept (--keep) is grown again instead of written anew."""
    me = [sys.executable, str(Path(__file__).resolve())]
    original, grown = where / f"{size}-original", where / f"{size}-grown"
    reused = reuse and (original / "model.safetensors.index.json").is_file()
    for p in (grown,) if reused else (original, grown):
        if p.exists():
            shutil.rmtree(p)
    where.mkdir(parents=True, exist_ok=True)
    result: dict = {"size": size, "spec": growth_spec(size), "stages": {}}
    try:
        if not reused:
            progress(f"writing a {size} checkpoint shard by shard")
            s, peak, _ = child([*me, "--write", str(original), "--size", size])
            result["stages"]["write checkpoint"] = (s, peak)
            _partial(where, result)
        result["input_bytes"] = sum(f.stat().st_size for f in original.glob("*.safetensors"))
        progress("graphgrow mutate (streamed)")
        cli = [sys.executable, "-m", "graphgrow.cli", "mutate", str(original)]
        for spec in growth_spec(size):
            cli += ["--pass", spec]
        budget = "1M" if size == "tiny" else "6G"  # tiny: below its size too, so that it streams
        s, peak, out = child([*cli, "-o", str(grown), "--max-memory", budget, "--json"])
        report = json.loads(out)
        result["stages"]["grow + verify + write (streamed)"] = (s, peak)
        result["report"] = {k: report[k] for k in ("streamed", "preservation", "timings", "native", "output_note")}
        result["output_bytes"] = sum(f.stat().st_size for f in grown.glob("*.safetensors"))
        _partial(where, result)
        progress("from_pretrained: the original's logits")
        s, peak, _ = child([*me, "--logits", str(original), str(where / "a.pt")])
        result["stages"]["from_pretrained + logits, original"] = (s, peak)
        _partial(where, result)
        progress("from_pretrained: the grown model's logits")
        s, peak, _ = child([*me, "--logits", str(grown), str(where / "b.pt")])
        result["stages"]["from_pretrained + logits, grown"] = (s, peak)
        a, b = torch.load(where / "a.pt"), torch.load(where / "b.pt")
        la, lb = a["logits"], b["logits"]
        # bf16 against bf16 adds two models' rounding; the reference that separates them is the original computed in
        # float32 on the same stored values: the grown model should be about as far from it as the original in bf16
        progress("from_pretrained: the original's logits in float32")
        s, peak, _ = child([*me, "--logits", str(original), str(where / "f.pt"), "--dtype", "float32"])
        result["stages"]["from_pretrained + logits, original in float32"] = (s, peak)
        lf = torch.load(where / "f.pt")["logits"]
        result["compare"] = {
            "params": [a["params"], b["params"]],
            "class": b["class"],
            "logits_max_abs_diff": float((la - lb).abs().max()),
            "logits_rel_err": rel_err(lb, la),
            "logits_scale": float(la.abs().max()),
            "same_argmax": float((la.argmax(-1) == lb.argmax(-1)).float().mean()),
            "same_greedy_tokens": bool(torch.equal(a["greedy"], b["greedy"])),
            "original_bf16_vs_float32_rel_err": rel_err(la, lf),
            "grown_bf16_vs_original_float32_rel_err": rel_err(lb, lf),
        }
        _partial(where, result)
        run_depth_only(size, where, result, progress)
        _partial(where, result)
        if mergekit_available():
            run_mergekit(size, where, result, progress)
    finally:
        if not keep:
            for p in (original, grown, where / "a.pt", where / "b.pt", where / "f.pt"):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                elif p.exists():
                    p.unlink()
    return result


def rows(size: str = "3b", where: Path = Path("/tmp/stream"), progress=lambda _: None) -> list:
    """The benchmark as rows of make bench's table (section scale): seconds per stage with its peak memory; the
    streamed growth's peak against the 6 GiB target; the logits against the original's."""
    from common import Row

    r = run(size, where, progress=progress)
    c = r["compare"]

    def count(n: int) -> str:
        return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"

    model = f"LLaMA {size} bf16 streamed ({count(c['params'][0])} → {count(c['params'][1])})"
    out = [
        Row(SECTION, model, stage, s, s, "s", note=f"peak {peak:.2f} GiB") for stage, (s, peak) in r["stages"].items()
    ]
    peak = r["stages"]["grow + verify + write (streamed)"][1]
    out.append(Row(SECTION, model, "streamed growth: peak RSS", peak, peak, "GiB", "≤ 6", peak <= 6))
    if "mergekit" in r:
        m = r["mergekit"]
        out.append(
            Row(
                SECTION,
                model,
                "mergekit passthrough: logits rel err vs original (bf16)",
                m["logits_rel_err"],
                m["logits_rel_err"],
                "",
                note=f"depth only, {count(m['params'])}; same argmax {m['same_argmax']:.0%}",
            )
        )
    else:
        out.append(Row(SECTION, model, "mergekit passthrough", 0, 0, "", note="not run: mergekit is not installed"))
    if "depth_only" in r:
        d = r["depth_only"]
        out.append(
            Row(
                SECTION,
                model,
                "graphgrow depth only: from_pretrained logits max |Δ| vs original (bf16)",
                d["logits_max_abs_diff"],
                d["logits_max_abs_diff"],
                "",
                "= 0",
                d["logits_max_abs_diff"] == 0,
                note=f"{count(d['params'])}; same greedy tokens {d['same_greedy_tokens']}",
            )
        )
    own, grown_err = c["original_bf16_vs_float32_rel_err"], c["grown_bf16_vs_original_float32_rel_err"]
    out.append(
        Row(
            SECTION,
            model,
            "from_pretrained logits, grown (bf16) vs original in float32: rel err",
            grown_err,
            grown_err,
            "",
            f"≤ 2 × {own:.2e} (the original's own bf16 error)",
            grown_err <= 2 * own,
        )
    )
    pres = r["report"]["preservation"]
    out.append(
        Row(
            SECTION,
            model,
            "streamed verification: logits rel err (float32, eval)",
            pres["eval"]["logits_rel_err"],
            pres["eval"]["logits_rel_err"],
            "",
            f"≤ {pres['tolerance']:.1e}",
            pres["eval"]["ok"],
        )
    )
    out.append(
        Row(
            SECTION,
            model,
            "from_pretrained logits vs original (bf16): max |Δ|",
            c["logits_max_abs_diff"],
            c["logits_max_abs_diff"],
            "",
            note=f"logit scale {c['logits_scale']:.3g}, rel {c['logits_rel_err']:.2e}, "
            f"same argmax {c['same_argmax']:.0%}, same greedy tokens {c['same_greedy_tokens']}",
        )
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--where", type=Path, default=Path("/tmp/stream"))
    parser.add_argument("--keep", action="store_true", help="keep the folders (and grow a kept checkpoint again)")
    parser.add_argument("--write", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--logits", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    parser.add_argument(
        "--mergekit-only", action="store_true", help="run only mergekit's stage on a kept checkpoint (after --keep)"
    )
    args = parser.parse_args()
    if args.write:
        return write_checkpoint(args.size, args.write)
    if args.logits:
        return logits_of(*args.logits, dtype=args.dtype)
    if args.mergekit_only:
        partial = args.where / f"{args.size}-partial.json"
        result = json.loads(partial.read_text()) if partial.exists() else {"size": args.size, "stages": {}}
        run_mergekit(args.size, args.where, result, lambda s: print(s, file=sys.stderr))
        partial.write_text(json.dumps(result, indent=1, default=str))
        return print(json.dumps(result, indent=1))
    print(
        json.dumps(
            run(args.size, args.where, args.keep, lambda s: print(s, file=sys.stderr), reuse=args.keep), indent=1
        )
    )


if __name__ == "__main__":
    main()
