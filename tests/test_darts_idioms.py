"""Issue 37, item 3: a DARTS network written as published NAS code writes it (tests/darts_published.py) traces
with no leaf in train and eval mode whatever spelling draws its drop-path mask — legacy typed constructors
(torch.cuda.FloatTensor, torch.FloatTensor, an alias of one), x.new / new_empty / new_zeros / new_full,
torch.empty / full / rand / ones with the input's device, bernoulli_ / torch.bernoulli / uniform_ / rand < p,
with and without Variable, in place or not — and the graph computes what the model computes, saves and
loads without trust and exports to ONNX in eval mode."""

from __future__ import annotations

import copy

import darts_published as dp
import pytest
import torch
from torch import fx, nn

import graphgrow as gg
from graphgrow.capture.trace import trace_report
from graphgrow.core.errors import TraceError
from graphgrow.io.mode_switch import ModeSwitch

SHAPE = (2, 3, 16, 16)
IDIOMS = list(dp.DROP_PATHS)


@pytest.fixture(autouse=True)
def cuda_masks_on_cpu(monkeypatch):
    """The published mask is a torch.cuda.FloatTensor: without CUDA, the *eager* model (the reference the traced
    graph is compared with) draws it on the CPU instead. Tracing never calls the class: the mask is read as
    the call it amounts to, whatever the name holds."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "FloatTensor", torch.FloatTensor)


def _train_logits(model: nn.Module, p: float, seed: int = 0) -> torch.Tensor:
    model.train()
    model.drop_path_prob = p
    torch.manual_seed(seed)
    x = torch.randn(*SHAPE)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        out = model(x)
    return out[0] if isinstance(out, (tuple, list)) else out


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    """Every call node of the graph and of its switches' bodies."""
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    for m in gm.modules():
        if isinstance(m, ModeSwitch):
            nodes += [n for body in m.bodies() for n in body.graph.nodes if n.op in ("call_function", "call_method")]
    return nodes


_TRACED: dict[tuple[str, str], tuple[nn.Module, fx.GraphModule]] = {}


def _traced(idiom: str, mode: str) -> tuple[nn.Module, fx.GraphModule]:
    """The network with its auxiliary head (so the top-level forward differs between modes), traced in `mode`
    (and checked against the model in both modes by trace's fidelity check); once per module."""
    if (idiom, mode) not in _TRACED:
        model = dp.network(idiom, auxiliary=True)
        _TRACED[idiom, mode] = model, gg.trace(model, SHAPE, mode=mode)
    return _TRACED[idiom, mode]


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("idiom", [i if i == "cuda_typed" else pytest.param(i, marks=pytest.mark.slow) for i in IDIOMS])
def test_every_mask_idiom_traces_with_no_leaf_computes_what_the_model_computes_and_loads_without_trust(
    idiom, mode, tmp_path
):
    model, gm = _traced(idiom, mode)
    report = trace_report(gm)
    assert report["auto_leaves"] == {}
    assert {f"cells.{i}" for i in range(4)} <= set(report["merged_blocks"])
    assert report["live_attributes"] == ["drop_path_prob"]
    assert report["top_level_mode_dependent"]
    calls = _calls(gm)
    # no typed class, no Variable and no x.new in the graph: the device-agnostic calls they amount to
    assert not any(n.target in torch._tensor_classes or n.target == "new" for n in calls), idiom
    assert any(
        n.target in ("bernoulli_", "bernoulli", "uniform_") or n.target is torch.bernoulli or n.target is torch.rand
        for n in calls
    ), idiom
    for p in (0.0, 0.3):  # train mode with drop-path on: the same draws, the same output
        assert torch.equal(_train_logits(gm, p), _train_logits(model, p)), (idiom, p)
    assert not torch.equal(_train_logits(gm, 0.0), _train_logits(gm, 0.5))  # the mask is drawn, not frozen

    path = tmp_path / "m.pt"
    gg.save_model(gm, path)
    loaded = gg.load_model(path).module  # no trust: every node, switch bodies included, on the closed list
    assert torch.equal(_train_logits(loaded, 0.3), _train_logits(model, 0.3))


# onnxruntime for the published spelling, traced in both modes. Every other spelling differs only in how the
# train-mode mask is drawn; the file holds the eval path, so what each spelling must show is that its eval path
# draws nothing and computes what the model computes: a forward in eval mode leaves the random generator's
# state as it was (no random op ran, so none can reach an export) and equals the eager model's output.
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_the_published_idiom_exports_in_eval_mode_and_agrees_on_onnxruntime(mode, tmp_path):
    from graphgrow.io.runtime import open_session

    _, gm = _traced("cuda_typed", mode)
    gm.drop_path_prob = 0.3  # eval mode takes the switches' eval path: no random op reaches the file
    onnx_path = tmp_path / "m.onnx"
    gg.export_onnx(gm, SHAPE, onnx_path)
    result = gg.check_equivalence(gm, open_session(onnx_path, "cpu"), SHAPE)
    assert result.passed, result
    gm.drop_path_prob = 0.2


@pytest.mark.slow
@pytest.mark.parametrize("idiom", [i for i in IDIOMS if i != "cuda_typed"])
def test_every_mask_idiom_draws_nothing_in_eval_mode_and_computes_what_the_model_computes(idiom):
    model, gm = _traced(idiom, "train")
    x = torch.randn(*SHAPE)
    for m in (model, gm):
        m.eval()
        m.drop_path_prob = 0.3
    try:
        state = torch.random.get_rng_state()
        with torch.no_grad():
            out = gm(x)
        assert torch.equal(torch.random.get_rng_state(), state), f"{idiom}: the eval path drew random numbers"
        with torch.no_grad():
            ref = model(x)
        out, ref = (o[0] if isinstance(o, (tuple, list)) else o for o in (out, ref))
        assert torch.equal(out, ref), idiom
    finally:
        for m in (model, gm):
            m.train()
            m.drop_path_prob = 0.2


def test_the_published_mask_becomes_a_mask_on_the_inputs_device_with_the_classs_dtype():
    gm = gg.trace(dp.network("cuda_typed"), SHAPE, check=False)
    empties = [n for n in _calls(gm) if n.target is torch.empty]
    assert empties
    for n in empties:
        assert n.kwargs["dtype"] is torch.float32
        device = n.kwargs["device"]
        assert device.target is getattr and device.args[1] == "device"  # read from the input at run time
    gm.to("meta").train()  # a device the source never named: the masks follow the input there
    gm.drop_path_prob = 0.3
    assert gm(torch.randn(*SHAPE, device="meta"))[0].device.type == "meta"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_model_traced_on_one_device_runs_on_the_other():
    """Traced on CUDA (where the published code runs), the graph runs on CPU, where the eager model cannot (its mask
    is a CUDA tensor); traced on CPU, it runs on CUDA and draws what the eager model draws there."""
    model = dp.network("cuda_typed").cuda()
    x = torch.randn(*SHAPE, device="cuda")
    gm = gg.trace(model, x.shape)
    for device in ("cpu", "cuda"):
        gm.to(device).train()
        torch.manual_seed(0)
        out = gm(x.to(device))[0]
        assert out.device.type == device
    model.train()
    gm.to("cuda")
    torch.manual_seed(3)
    want = model(x)[0]
    torch.manual_seed(3)
    assert torch.equal(gm(x)[0], want)


class _DataMask(nn.Module):
    """A tensor made from data, not sizes: `torch.FloatTensor([n, 1])` holds the numbers n and 1."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        h = self.conv(x)
        if self.training:
            h = h * torch.FloatTensor([h.size(0), 1]).sum()
        return h


class _ConstantOnOnePath(nn.Module):
    """One path reads a tensor made at trace time (a constant), which a switch body cannot hold."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        h = self.conv(x)
        if self.training:
            h = h * torch.tensor([0.5])
        return h


def test_a_legacy_call_that_cannot_be_read_is_refused_naming_the_call_and_the_line():
    model = nn.Sequential(_DataMask(), nn.Conv2d(3, 2, 1))
    gm = gg.trace(model, SHAPE)
    reason = trace_report(gm)["auto_leaves"]["0"]
    assert "torch.FloatTensor(...) at test_darts_idioms.py:" in reason and "torch.FloatTensor([h.size(0), 1])" in reason
    with pytest.raises(TraceError, match=r"torch\.FloatTensor\(\.\.\.\) at test_darts_idioms\.py:\d+"):
        gg.trace(model, SHAPE, auto_leaves=False)


def test_a_merge_failure_names_the_line_of_the_models_code():
    gm = gg.trace(nn.Sequential(_ConstantOnOnePath(), nn.Conv2d(3, 2, 1)), SHAPE)
    reason = trace_report(gm)["auto_leaves"]["0"]
    assert "at test_darts_idioms.py:" in reason and "h = h * torch.tensor([0.5])" in reason, reason


def test_typed_classes_and_variable_behave_as_before_outside_and_inside_a_trace():
    """While a trace runs, the stand-ins still make tensors from plain arguments and answer isinstance."""

    class Checks(nn.Module):
        def forward(self, x):
            t = torch.FloatTensor(2, 3)
            assert isinstance(t, torch.FloatTensor) and not isinstance(t, torch.DoubleTensor)
            assert dp.Variable(t) is not t
            return x + 1

    gg.trace(Checks(), (2, 3))
    assert isinstance(torch.zeros(1), torch.FloatTensor) and type(torch.FloatTensor) is not type(lambda: 0)
    assert "__new__" not in vars(dp.Variable)


# each built-in growth pass, placed inside the published network's cells (a preprocessing conv's group, beside a
# reduction cell's pooling edge, after a separable conv, after a dilated conv's BN, across a cell's first node)
CELL_SPECS = [
    "grow_width(target=cells.1.preprocess1.op.1)",
    "add_branch(op=sepconv3x3,at=cells_1__ops_0)",
    "deepen(after=cells_0__ops_0_op_7)",
    "insert_adapter(after=cells_3__ops_2_op_3)",
    "add_residual(start=cells_0_preprocess1_op_2,end=cells_0__ops_2_op_3)",
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", CELL_SPECS)
def test_growth_inside_the_published_cells_is_exact_with_drop_path_running(spec):
    model, gm = _traced("cuda_typed", "train")
    r = gg.Pipeline.from_spec(spec, seed=1).run(gm).results[0]  # verified in eval and train mode
    assert r.params_after > r.params_before
    for p in (0.0, 0.4):
        assert torch.allclose(_train_logits(r.gm, p), _train_logits(model, p), rtol=1e-5, atol=1e-6), (spec, p)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, train: bool) -> float:
    """The training loss (logits + 0.4 · auxiliary in train mode) on a fixed batch, drop-path drawn from seed 7; a
    train-mode probe runs on a copy (it would move BatchNorm's running statistics)."""
    model = copy.deepcopy(model) if train else model
    model.train(train)
    torch.manual_seed(7)
    with torch.no_grad():
        logits, aux = model(x)
        loss = nn.functional.cross_entropy(logits, y)
        return float(loss + 0.4 * nn.functional.cross_entropy(aux, y)) if aux is not None else float(loss)


@pytest.mark.slow
def test_the_seeds_scenario_grows_a_published_style_network_four_times_while_it_trains(tmp_path):
    """Issue 37 item 4: the published spelling (torch.cuda.FloatTensor + Variable, in place), traced in train mode
    with its auxiliary head and no leaf; four growth events during training (grow_width, add_branch, deepen,
    grow_width again) with drop_path_prob changed every epoch and the optimiser carried; the loss identical at
    each event in eval and train mode; the result exported and checked on onnxruntime."""
    from graphgrow.io.runtime import open_session

    gm = gg.trace(dp.network("cuda_typed", auxiliary=True), SHAPE, mode="train")
    assert trace_report(gm)["auto_leaves"] == {}
    events = {
        1: "grow_width(target=cells.1.preprocess1.op.1)",
        2: "add_branch(op=sepconv3x3)",
        3: "deepen",
        4: "grow_width",
    }
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 16, 16, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    probe_x, probe_y = x[:8], y[:8]
    opt = torch.optim.SGD(gm.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(6):
        gm.drop_path_prob = 0.3 * epoch / 6
        if epoch in events:
            before = _loss(gm, probe_x, probe_y, False), _loss(gm, probe_x, probe_y, True)
            result = gg.Pipeline.from_spec(events[epoch], seed=epoch).run(gm).results[0]
            assert result.params_after > result.params_before, events[epoch]
            opt = gg.carry_optimizer(opt, gm, result.gm)
            gm = result.gm
            after = _loss(gm, probe_x, probe_y, False), _loss(gm, probe_x, probe_y, True)
            assert after == pytest.approx(before, rel=1e-5, abs=1e-6), (events[epoch], before, after)
        gm.train()
        for i in range(0, 16, 8):
            opt.zero_grad()
            logits, aux = gm(x[i : i + 8])
            loss = nn.functional.cross_entropy(logits, y[i : i + 8]) + 0.4 * nn.functional.cross_entropy(
                aux, y[i : i + 8]
            )
            loss.backward()
            opt.step()
    assert trace_report(gm)["auto_leaves"] == {}
    gm.eval()
    onnx_path = tmp_path / "grown.onnx"
    gg.export_onnx(gm, SHAPE, onnx_path)
    assert gg.check_equivalence(gm, open_session(onnx_path, "cpu"), SHAPE).passed
