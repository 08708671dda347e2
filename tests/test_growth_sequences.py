"""Growth sequences as a property: graphgrow grows what it grew.

On five architectures written the way their kinds are usually written (tests/growth_models.py), a seeded random
sequence of 8 passes — every built-in growth pass, at its default place or at a random place its `candidates`
lists, with random valid arguments — runs one pass at a time. Each step is verified (exact in eval and train mode,
every new parameter trainable) or refused with a typed error whose reason is about the user's model: a refusal that
cites a module or node an earlier step added, or anything "not understood", fails the test. The result of each
sequence saves, loads without trust, exports to ONNX and agrees on onnxruntime.

`make test` runs one sequence per architecture; `make fuzz` runs GRAPHGROW_SEQUENCES of them (count and time
printed at the end).
"""

from __future__ import annotations

import operator
import os
import random
import re
import time
from collections import Counter

import pytest
import torch
from growth_models import ARCHITECTURES
from torch import fx

import graphgrow as gg

pytestmark = pytest.mark.usefixtures("one_thread")
SEQUENCES = int(os.environ.get("GRAPHGROW_SEQUENCES", "1"))
STEPS = 8
PASSES = ("grow_width", "add_branch", "deepen", "insert_adapter", "add_residual", "grow_hidden", "grow_heads")
ARGUMENTS = {  # argument variants drawn per pass (each a valid value; the place comes from candidates or the default)
    "grow_width": [{}, {"factor": 1.5}, {"init": "net2net"}, {"mode": "adapter"}],
    "add_branch": [
        {"op": op} for op in ("conv3x3", "conv5x5", "sepconv3x3", "dilconv3x3", "avgpool3x3", "maxpool3x3", "identity")
    ],
    "deepen": [{}],
    "insert_adapter": [{}],
    "add_residual": [{}],
    "grow_hidden": [{}, {"by": 8}],
    "grow_heads": [{}],
}
STATS: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def report_campaign():
    start = time.perf_counter()
    yield
    print(
        f"\ngrowth sequences: {sum(STATS.values())} steps in {time.perf_counter() - start:.1f}s: "
        + ", ".join(f"{k} {v}" for k, v in sorted(STATS.items()))
    )


def _draw(rng: random.Random, gm) -> str:
    name = rng.choice(PASSES)
    args = dict(rng.choice(ARGUMENTS[name]))
    if rng.random() < 0.5:
        try:
            places = gg.get_pass(name)(**args).candidates(gm)
        except gg.GraphgrowError:
            places = []
        if places:
            args = {**rng.choice(places).args, **args}
    return f"{name}({','.join(f'{k}={v}' for k, v in args.items())})" if args else name


def _cites_an_addition(message: str, added: set[str]) -> str | None:
    """The first name graphgrow added (module path or node name) the message quotes, else None."""
    quoted = set(re.findall(r"'([^']+)'", message))
    for q in quoted:
        if q in added or q.split(".")[0] in added:
            return q
    return None


def _run_sequence(arch: str, seed: int):
    factory, spec = ARCHITECTURES[arch]
    rng = random.Random(f"{arch}-{seed}")
    torch.manual_seed(seed)
    gm = gg.trace(factory(), spec)
    original = {n.name for n in gm.graph.nodes} | {m for m, _ in gm.named_modules()}
    added: set[str] = set()
    history = []
    for step in range(STEPS):
        text = _draw(rng, gm)
        try:
            result = gg.Pipeline.from_spec(text, seed=step).run(gm).results[-1]
        except (gg.PreservationError, gg.ValidationError) as e:
            pytest.fail(f"{arch} seed {seed}: {history + [text]}: the pass broke its promise: {e}")
        except gg.GraphgrowError as e:
            STATS[f"refused ({type(e).__name__})"] += 1
            message = str(e)
            assert "\n" not in e.message, message
            assert "not understood" not in message, f"{arch} {history + [text]}: {message}"
            cited = _cites_an_addition(message, added)
            assert cited is None, (
                f"{arch} seed {seed}: {history + [text]} refused citing graphgrow's own '{cited}': {message}"
            )
            history.append(f"{text} ✗")
            continue
        report = result.preservation
        if report is not None:
            assert report.eval.ok and report.train.ok and report.trainable_ok, (arch, history, text)
        STATS["verified"] += 1
        history.append(text)
        gm = result.gm
        added |= ({n.name for n in gm.graph.nodes} | {m for m, _ in gm.named_modules()}) - original
    return gm, spec, history


@pytest.mark.parametrize("seed", range(SEQUENCES))
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_growth_sequences_verify_or_refuse_for_the_users_model(arch, seed, tmp_path):
    from graphgrow.graph.inputs import parse_spec
    from graphgrow.io.export import export_onnx
    from graphgrow.io.runtime import max_ir_version, open_session
    from graphgrow.verify.equivalence import check_equivalence

    gm, spec, history = _run_sequence(arch, seed)
    assert any(not h.endswith("✗") for h in history), f"{arch}: nothing grew in {history}"
    path = gg.save_model(gm, tmp_path / f"{arch}.pt")
    loaded = gg.load_model(path).module  # no trust: only graphgrow's own data
    x = {"input_ids": torch.randint(0, 64, (2, 16))} if isinstance(spec, str) else {"x": torch.randn(*spec)}
    gm.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(gm(*x.values()), loaded(*x.values())), history
    shape = parse_spec(spec) if isinstance(spec, str) else spec
    onnx_path = tmp_path / f"{arch}.onnx"
    export_onnx(loaded, shape, onnx_path, max_ir_version=max_ir_version())
    assert check_equivalence(loaded, open_session(onnx_path, "cpu"), shape, raise_on_failure=True).passed, history


@pytest.mark.parametrize(
    "spec", ["grow_hidden", "grow_width(target=blocks.1.mlp.2,init=net2net)", "add_residual,grow_hidden"]
)
def test_sizes_read_at_run_time_keep_their_meaning(spec):
    """TinyViT splits its fused qkv with `B, N, C = x.shape; reshape(B, N, 3, heads, C // heads)`: when the stream
    (C) grows, the qkv output does not, so that C must stay the old width (it was a ValidationError: the grown
    reshape could not be sized). add_residual's gate (a one-element parameter) is a scalar on the stream."""
    factory, shape = ARCHITECTURES["tiny_vit"]
    torch.manual_seed(0)
    result = gg.Pipeline.from_spec(spec).run(gg.trace(factory(), shape)).results[-1]
    assert result.preservation.eval.ok and result.preservation.train.ok and result.preservation.trainable_ok
    reshape = next(n for n in result.gm.graph.nodes if n.name == "reshape")
    assert 32 in list(reshape.args[1:]) or any(
        isinstance(a, fx.Node) and a.target is operator.floordiv and 32 in a.args for a in reshape.args[1:]
    ), reshape.args
