"""Shared fixtures: small models, a CLI runner, and helpers that check the promise independently."""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from graphgrow.graph.layers import AverageMerge

ROOT = Path(__file__).resolve().parent.parent


def _share_the_cores() -> None:
    """Under pytest-xdist, give each of the n workers its share of the cores (and the CLI processes it starts, through
    OMP_NUM_THREADS): torch's default, every core per process, makes n workers' kernels wait at each other's barriers
    (core/threads.py measured 4-15× on a busy 2-core machine). A thread count set by the user is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


_share_the_cores()


def small_cnn(first: int = 32) -> nn.Sequential:
    """3×32×32 → 128×8×8 features, global pooling, classifier (the issue's example); `first`: the first conv's width."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, first, 3, padding=1),
        nn.BatchNorm2d(first),
        nn.ReLU(),
        nn.Conv2d(first, 64, 3, stride=2, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Conv2d(64, 128, 3, stride=2, padding=1),
        nn.BatchNorm2d(128),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def mlp() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BatchNorm statistics and affine parameters, so eval ≠ train and mistakes show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model


def trained_looking(gm: nn.Module, seed: int = 1) -> nn.Module:
    """As if trained: BatchNorm statistics and affine, merge gates and scalar gates all non-zero (some negative)."""
    randomize_bn(gm, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in gm.modules():
            if isinstance(m, AverageMerge):
                m.gates.copy_(torch.randn(m.gates.shape, generator=g))
        for p in gm.parameters():
            if p.dim() == 0:
                p.copy_(torch.randn((), generator=g))
    return gm


def snapshot(model: nn.Module) -> dict:
    """Everything that must stay bit-identical: tensors, training flags."""
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "training": [m.training for m in model.modules()],
    }


def assert_same_snapshot(a: dict, b: dict) -> None:
    assert a["training"] == b["training"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), f"{k} changed"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / a.norm()).item()


def outputs_both_modes(model: nn.Module, x: torch.Tensor, seed: int = 0):
    """(eval output, train output) computed on a deep copy, so the model is not touched."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.eval()
        ev = m(x)
        m.train()
        torch.manual_seed(seed)
        tr = m(x)
    return ev, tr


@pytest.fixture
def cnn():
    return randomize_bn(small_cnn())


@pytest.fixture
def cnn_file(tmp_path, cnn):
    p = tmp_path / "model.pt"
    torch.save(cnn, p)
    return p


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is ten times faster than two fighting over a busy machine's cores (opt in per module:
    pytestmark = pytest.mark.usefixtures("one_thread"))."""
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


@pytest.fixture
def runner():
    return CliRunner()


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """A real `graphgrow` process (exit codes and stderr exactly as a user sees them), forked from a warm parent that
    has imported what the CLI imports at start (tests/cli_fork.py: ~2 s of CPU saved per call)."""
    import cli_fork

    return cli_fork.run(list(args), cwd, {**os.environ, **(env or {})})


# a small LLaMA (RoPE, RMSNorm, grouped-query attention, SwiGLU) by name, as a user gives it to the CLI
LLAMA = (
    "hf:llama/causal-lm(vocab_size=64,hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
    "num_key_value_heads=2,max_position_embeddings=32)"
)


def assert_onnx_agrees(gm, spec: str, path: Path) -> None:
    """Export `gm` with the named-input `spec` to `path` and check it on onnxruntime's CPU provider."""
    from graphgrow.graph.inputs import parse_spec
    from graphgrow.io.export import export_onnx
    from graphgrow.io.runtime import max_ir_version, open_session
    from graphgrow.verify.equivalence import check_equivalence

    export_onnx(gm, parse_spec(spec), path, max_ir_version=max_ir_version())
    assert check_equivalence(gm, open_session(path, "cpu"), parse_spec(spec), raise_on_failure=True).passed


def grown(model: nn.Module, shape: tuple[int, ...], **kw):
    """GrowWidth(**kw) on the traced `model` (BatchNorm randomized first), asserting the growth preserved behaviour."""
    from graphgrow.passes.grow_width import GrowWidth

    import graphgrow as gg

    torch.manual_seed(0)
    r = GrowWidth(**kw)(gg.trace(randomize_bn(model), shape))
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok
    return r


def grow_checked(model: nn.Module, inputs: str, pass_name: str, capture: str = "fx", **pass_args):
    """The pass `pass_name(**pass_args)` on `model` traced at `inputs` (an input spec: "x:2x3x8x8", "ids:2x6:int64")
    with `capture`, asserting that the growth kept the outputs in eval and train mode and that its new parameters
    learn; returns the pass's result."""
    import graphgrow as gg
    from graphgrow.graph.inputs import parse_spec

    r = gg.get_pass(pass_name)(**pass_args)(gg.trace(model, input_shape=parse_spec(inputs), capture=capture))
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok, r.preservation
    return r


# `make test-quick` runs `pytest -m fast`; this is the one place that says what is fast: every test not marked slow
# (real models, ONNX export of them, whole docs blocks, mypy over the tree) outside the files below, which start a
# process per test or build a model family per test. tests/test_imports.py keeps every module imported and every
# pass run in the fast set.
NOT_FAST_FILES = {
    "test_hostile.py",
    "test_hostile_code.py",
    "test_hostile_outputs.py",
    "test_hostile_names.py",  # CLI processes:
    "test_hostile_bounds.py",
    "test_cli.py",
    "test_export_names.py",
    "test_plugin_example.py",  # exit codes, signals
    "test_cli_fork.py",  # the warm CLI against fresh processes
    "test_distributed.py",  # torchrun jobs
    "test_bench_scale_decoder.py",  # the scale benchmark's every stage, ONNX export included
    "test_hf_pass_matrix.py",
    "test_zoo_hf.py",
    "test_hf_cli.py",
    "test_model_names.py",  # model families × passes
    "test_native.py",  # Hugging Face classes × grown sizes, and folders through the CLI
}


def _file_seconds() -> dict[str, float]:
    """Each test file's measured total (tests/file_times.json, written by `python tools/test_times.py
    --write-order tests/file_times.json` from a `make test` run); {} when absent or unreadable."""
    import json

    try:
        return {k: float(v) for k, v in json.loads((ROOT / "tests" / "file_times.json").read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("slow") is None and item.path.name not in NOT_FAST_FILES:
            item.add_marker(pytest.mark.fast)
    # The longest files first, each file's tests kept together and in order (module fixtures are built once):
    # xdist hands tests out in this order, so the two workers' last tests are short ones and they end together,
    # where a long file collected last kept one worker busy minutes after the other had finished. A file the
    # record does not name follows the ones it names, in collection order.
    seconds = _file_seconds()
    order = {item.path: i for i, item in reversed(list(enumerate(items)))}
    items.sort(key=lambda it: (-seconds.get(f"tests/{it.path.name}", 0.0), order[it.path]))
