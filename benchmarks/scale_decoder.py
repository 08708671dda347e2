"""A decoder-only transformer at 125 M / 350 M / 1 B parameters and one growth pipeline through the jobs a user runs
(issue 27, items 1 and 5): trace, deepen by one block, widen one block's MLP (grow_width on its fc1), grow the hidden
size, each pass and its verification, the graphgrow file, the ONNX export (with external data: NAME.onnx +
NAME.onnx.data) and the onnxruntime check.

Each stage reports its seconds and its peak resident memory (Linux: VmHWM after resetting it through
/proc/self/clear_refs, with the heap trimmed first) above the process's baseline before the model was built, as a
multiple of the grown model's weight bytes; beside it, graphgrow's own estimate of what the run needs
(analysis/budget.run_memory).

Plain torch, random weights, nothing downloaded: token embedding, pre-norm blocks (LayerNorm, attention through
F.scaled_dot_product_attention, a GELU MLP), a final LayerNorm and an untied LM head.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 32000
# name → (hidden size, layers, heads); MLP 4× hidden, vocabulary 32,000, untied head
SIZES = {
    "tiny": (32, 2, 2, 64),
    "125m": (768, 12, 12, VOCAB),
    "350m": (1024, 24, 16, VOCAB),
    "1b": (2048, 18, 16, VOCAB),
}


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def decoder(size: str, seed: int = 0) -> Decoder:
    """The decoder of SIZES[size], GPT-2-like initialisation (normal 0.02, residual writers scaled by depth)."""
    d, layers, heads, vocab = SIZES[size]
    torch.manual_seed(seed)
    with torch.device("meta"):  # allocate once, initialise in place: no default init followed by a second one
        model = Decoder(d, layers, heads, vocab)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if name.endswith("weight") else 0.0)  # norm gains 1, biases 0
            else:
                p.normal_(0.0, 0.02 / (math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) else 1.0))
    return model.eval()


def pipeline_spec(size: str) -> list[str]:
    """deepen by one transformer block, widen the MLP of block 0 by half, grow the hidden size by 1/16."""
    d = SIZES[size][0]
    return [
        "deepen(block=transformer)",
        f"grow_width(target=blocks.0.mlp.fc1,to={6 * d})",
        f"grow_hidden(to={d + d // 16})",
    ]


def input_spec(seq: int = 16):
    from graphgrow.graph.inputs import parse_spec

    return parse_spec(f"input_ids:1x{seq}:int64")


def _distinct_bytes(models: list[nn.Module]) -> int:
    """Bytes of the tensors of `models`, each storage counted once (models share the tensors a pass left alone)."""
    seen: dict[int, int] = {}
    for m in models:
        for t in m.state_dict().values():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


class Peak:
    """Peak resident memory of this process since the last reset (Linux VmHWM; resident memory elsewhere)."""

    def reset(self) -> None:
        """Start a stage: garbage collected, freed heap memory handed back to the system (glibc keeps freed
        blocks resident; malloc_trim), then the peak reset, so a stage's peak is what it needs."""
        gc.collect()
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")

    @staticmethod
    def _status(key: str) -> int:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def high(self) -> int:
        return self._status("VmHWM")

    def now(self) -> int:
        return self._status("VmRSS")


@dataclass
class Stage:
    name: str
    seconds: float
    peak: int  # bytes of resident memory above the baseline (the process before the model was built)
    estimate: int | None = None  # graphgrow's estimate of what the stage needs (budget.run_memory), bytes
    note: str = ""


def run(
    size: str,
    out_dir: Path,
    seq: int = 16,
    export: bool = True,
    share_input: bool = False,
    max_memory: int | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[list[Stage], dict]:
    """Every stage on the decoder of `size`; (stages, facts: parameters before/after, grown weight bytes, baseline)."""
    import graphgrow as gg
    from graphgrow.analysis.budget import Limits, estimate_pass
    from graphgrow.io.runtime import open_session
    from graphgrow.verify.verify import verify

    peak, stages = Peak(), []
    limits = (
        Limits(max_memory=max_memory) if max_memory else None
    )  # --max-memory: what a pass may need beyond its input
    spec = input_spec(seq)
    peak.reset()
    baseline = peak.now()
    state: dict = {}

    def stage(name: str, fn: Callable[[], object], note: str = "") -> bool:
        """Run one stage; a stage that fails is recorded with its error (the ones after it still run when they can)."""
        progress(f"decoder {size}: {name}")
        peak.reset()
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # a stage that does not fit or fails: the row says which stage and why
            note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        seconds = time.perf_counter() - t
        stages.append(Stage(name, seconds, max(0, peak.high() - baseline), note=note))
        return not note.startswith("failed")

    stage("build (random weights)", lambda: state.update(model=decoder(size)))
    params_before = sum(p.numel() for p in state["model"].parameters())
    stage("trace + fidelity", lambda: state.update(gm=gg.trace(state["model"], input_shape=spec)))
    del state["model"]  # the traced graph holds the weights; a user keeps one of the two
    chain = [state.pop("gm")]  # every intermediate model stays alive, as in PipelineResult.results
    for i, text in enumerate(pipeline_spec(size)):
        name, p = text.split("(")[0], gg.Pipeline.from_spec(text).passes[0]
        share = share_input or i > 0  # as Pipeline.run shares: its own intermediate models, the input when asked
        # graphgrow's estimate (what --max-memory is checked against) plus what is alive already: every model so far
        estimate = estimate_pass(
            lambda m, p=p: p.apply(m, torch.Generator().manual_seed(0)).gm, chain[-1], spec, share
        ).total
        estimate += _distinct_bytes(chain)
        if not stage(
            f"{name}: pass",
            lambda p=p, share=share: state.update(result=p(chain[-1], verify_result=False, share=share, limits=limits)),
        ):
            break
        new = state.pop("result").gm
        verified = stage(f"{name}: verification", lambda new=new: verify(chain[-1], new, spec))
        stages[-2].estimate = stages[-1].estimate = estimate
        if not verified:
            break
        chain.append(new)
    grown = chain[-1]
    facts = {
        "params_before": params_before,
        "params_after": sum(p.numel() for p in grown.parameters()),
        "grown_bytes": weight_bytes(grown),
        "baseline": baseline,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    stage("save (graphgrow file)", lambda: gg.save_model(grown, out_dir / f"decoder_{size}.pt"))
    if export:
        onnx_path = out_dir / f"decoder_{size}.onnx"
        if stage("ONNX export (external data)", lambda: gg.export_onnx(grown, spec, onnx_path, external_data=True)):
            stage("onnxruntime check", lambda: _check(gg, grown, open_session(onnx_path), spec))
    return stages, facts


def _check(gg, grown, session, spec) -> None:
    report = gg.check_equivalence(grown, session, spec)
    if not report.passed:
        raise AssertionError(f"onnxruntime disagrees with PyTorch: {report.to_json()}")


def watchdog(limit: int, peak: Peak | None = None) -> None:
    """End this process (exit 3, saying so) when its resident memory passes `limit` bytes: a run that would not fit
    stops before the machine starts swapping or killing its neighbours."""
    import os
    import sys
    import threading

    peak = peak or Peak()

    def watch() -> None:
        while True:
            rss = peak.now()
            if rss > limit:
                print(
                    f"stopped: resident memory {rss / 2**30:.1f} GiB passed the limit {limit / 2**30:.1f} GiB",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(3)
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    """One size in this process: `python scale_decoder.py SIZE OUT_DIR [--seq N] [--no-export] [--limit-gib G]`,
    the stages as JSON on stdout (bench_scale.py runs one process per size)."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser()
    ap.add_argument("size", choices=list(SIZES))
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--share-input", action="store_true", help="Pipeline(share=True): the input's weights shared too")
    ap.add_argument("--limit-gib", type=float, default=16.0)
    args = ap.parse_args()
    watchdog(int(args.limit_gib * 2**30))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if (
        args.size != "tiny"
    ):  # the one-time imports and caches of every stage, so that they are not counted as the model's
        run("tiny", args.out_dir / "warm-up", seq=args.seq, export=not args.no_export)
    stages, facts = run(
        args.size,
        args.out_dir,
        seq=args.seq,
        export=not args.no_export,
        share_input=args.share_input,
        max_memory=int(args.limit_gib * 2**30),
        progress=lambda s: print(s, file=sys.stderr, flush=True),
    )
    print(json.dumps({"facts": facts, "stages": [vars(s) for s in stages]}))


if __name__ == "__main__":
    main()
