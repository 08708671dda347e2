"""Issue 25: DARTS-style cells are traced through (every path of their drop-path branch merged into run-time
switches), their drop-path schedule stays live, and growth lands inside cells, verified and checked on onnxruntime."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from conftest import ROOT
from torch import nn

import graphgrow as gg
from graphgrow import LoadError
from graphgrow.capture.trace import trace_report
from graphgrow.io import serialize
from graphgrow.io.mode_switch import ModeSwitch

sys.path.insert(0, str(ROOT / "examples"))
import darts_net as dn  # noqa: E402

SHAPE = (2, 3, 32, 32)


def _train_logits(model: nn.Module, p: float, seed: int = 0) -> torch.Tensor:
    model.train()
    model.drop_path_prob = p
    torch.manual_seed(seed)
    x = torch.randn(*SHAPE)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        return dn.split_output(model(x))[0]


@pytest.fixture(scope="module")
def traced():
    model = dn.small_darts(auxiliary=False)
    return model, gg.trace(model, SHAPE)


@pytest.mark.parametrize("genotype", list(dn.GENOTYPES))
def test_no_cell_is_a_leaf_and_the_schedule_is_read_at_run_time(genotype):
    model = dn.small_darts(genotype=dn.GENOTYPES[genotype])
    gm = gg.trace(model, SHAPE)
    report = trace_report(gm)
    assert report["auto_leaves"] == {}
    assert {f"cells.{i}" for i in range(5)} <= set(report["merged_blocks"])
    assert report["live_attributes"] == ["drop_path_prob"]
    switches = [m for m in gm.modules() if isinstance(m, ModeSwitch)]
    assert switches and all(len(s.table) == 3 for s in switches)  # training∧p>0, training∧¬(p>0), ¬training
    for p in (0.0, 0.3, 0.7):  # the graph follows the attribute exactly as the model does
        assert torch.equal(_train_logits(gm, p), _train_logits(model, p)), p
    assert not torch.equal(_train_logits(gm, 0.0), _train_logits(gm, 0.3))


def test_eval_mode_draws_nothing_and_matches(traced):
    model, gm = traced
    model.eval()
    gm.eval()
    gm.drop_path_prob = model.drop_path_prob = 0.5
    x = torch.randn(*SHAPE)
    state = torch.random.get_rng_state()
    out = gm(x)
    assert torch.equal(torch.random.get_rng_state(), state)  # the train-only path never ran
    assert torch.equal(out, dn.split_output(model(x))[0])
    gm.drop_path_prob = model.drop_path_prob = 0.0


SPECS = [
    "grow_width(target=cells.1.preprocess1.1)",  # a cell's preprocessing ReLU-conv-BN
    "grow_width(target=cells.0._ops.0.0.2)",  # the first half of a separable conv (pointwise → second depthwise)
    "grow_width(target=cells.2._ops.2.1.2)",  # a node's output through the concat into later cells' preprocessing
    "grow_width",
    "add_branch",
    "add_branch(op=sepconv3x3)",
    "add_branch(op=sepconv3x3,at=cells_1__ops_0)",  # beside a pooling edge of a reduction cell (stride 2)
    "deepen(after=cells_2__ops_0_1_3)",  # inside a normal cell, after a separable conv
    "deepen",
    "insert_adapter",
    "add_residual",
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_growth_inside_cells_is_exact_with_the_schedule_running_and_exports(traced, spec, tmp_path):
    model, gm = traced
    r = gg.Pipeline.from_spec(spec, seed=1).run(gm).results[0]
    grown = r.gm
    assert r.params_after > r.params_before
    for p in (0.0, 0.4):  # train mode with drop-path on: same draws, same output
        assert torch.allclose(_train_logits(grown, p), _train_logits(model, p), rtol=1e-5, atol=1e-6), (spec, p)
    if "=" not in spec:
        return  # the default places: exact with drop-path on is the point; onnxruntime checks the ones inside cells
    grown.drop_path_prob = 0.0
    from graphgrow.io.runtime import open_session

    onnx_path = tmp_path / "g.onnx"
    gg.export_onnx(grown, SHAPE, onnx_path)
    report = gg.check_equivalence(grown, open_session(onnx_path, "cpu"), SHAPE)
    assert report.passed, report


def test_a_grown_darts_network_round_trips_through_a_file_without_trust(traced, tmp_path):
    model, gm = traced
    grown = gg.Pipeline.from_spec("grow_width(target=cells.1.preprocess1.1)", seed=2).run(gm).results[0].gm
    path = tmp_path / "grown.pt"
    gg.save_model(grown, path)
    loaded = gg.load_model(path).module
    for p in (0.0, 0.35):
        assert torch.allclose(_train_logits(loaded, p), _train_logits(model, p), rtol=1e-5, atol=1e-6)


def _payload(gm):
    return serialize.to_payload(copy.deepcopy(gm))  # the payload holds the model's own modules: edit a copy


def test_a_switch_body_from_a_file_is_checked_like_the_main_graph(traced):
    _, gm = traced
    payload = _payload(gm)
    switch = payload["root"].get_submodule("cells.0.mode_switch_0")
    record = next(r for body in switch.body_records for r in body if r["op"] == "call_method")
    record["op"], record["target"] = "call_function", "os.system"
    with pytest.raises(LoadError, match="os.system"):
        serialize.from_payload(payload)


def test_a_malformed_switch_table_is_refused(traced):
    _, gm = traced
    payload = _payload(gm)
    switch = payload["root"].get_submodule("cells.0.mode_switch_0")
    switch.table = [[[99, True]]] * len(switch.body_records)
    with pytest.raises(LoadError, match="malformed table"):
        serialize.from_payload(payload)


def test_a_huge_constant_mask_in_a_body_is_refused(traced):
    _, gm = traced
    payload = _payload(gm)
    switch = payload["root"].get_submodule("cells.0.mode_switch_0")
    record = next(r for body in switch.body_records for r in body if r["target"] == "torch.empty")
    record["args"] = {"tuple": [1 << 20, 1 << 20]}
    with pytest.raises(LoadError, match="elements from constants"):
        serialize.from_payload(payload)


@pytest.mark.slow  # ONNX exports: make test runs it, not the edit loop
def test_fold_drops_the_train_only_work_and_onnx_has_none_of_it(traced, tmp_path):
    import onnx

    model, gm = traced
    r = gg.fold(gm)
    assert not any(isinstance(m, ModeSwitch) for m in r.gm.modules())  # eval semantics: drop-path is the identity
    assert r.preservation.eval.ok
    path = tmp_path / "d.onnx"
    gg.export_onnx(gm, SHAPE, path)
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert not ops & {"Bernoulli", "RandomUniform", "RandomUniformLike", "RandomNormalLike", "If"}, ops


def test_tracing_leaves_the_model_as_it_was():
    model = dn.small_darts(auxiliary=False)
    before = set(vars(model))
    gg.trace(model, SHAPE)
    assert set(vars(model)) == before  # fx parks tensor constants on the model it traces; none stay
    assert type(model) is dn.NetworkCIFAR and all(type(c) is dn.Cell for c in model.cells)  # classes put back
