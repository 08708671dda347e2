"""Lineage: a grown model records the structure fingerprint of the network it was grown from, so
`graphgrow diff` and `graphgrow replay` refuse models that only share a mutation log, a reversed pair,
or a model that is not on the way; replay onto a model part of the way applies only the rest."""

from __future__ import annotations

import json

import onnx
import pytest
import torch
from conftest import small_cnn
from torch import nn

import graphgrow as gg
from graphgrow.core.errors import InputError, LoadError
from graphgrow.io import serialize
from graphgrow.io.lineage import ORIGIN_KEY, structure_fingerprint
from graphgrow.jobs import workflow

SHAPE = (1, 3, 32, 32)
SPEC = "deepen(after=_5),grow_width(target=_0)"


def narrow_cnn() -> nn.Sequential:
    """small_cnn's layout with another width: node names (and so the mutation log) match, the network does not."""
    return small_cnn(first=16)


def grow(model: nn.Module, spec: str = SPEC):
    gm = gg.trace(model, input_shape=SHAPE)
    return gm, gg.Pipeline.from_spec(spec).run(gm).gm


@pytest.fixture
def files(tmp_path):
    gm, grown = grow(small_cnn())
    torch.save(small_cnn(), tmp_path / "model.pt")
    gg.save_model(grown, tmp_path / "grown.pt")
    gg.save_model(gg.fold(grown).gm, tmp_path / "folded.pt")
    _, other = grow(narrow_cnn())
    gg.save_model(other, tmp_path / "other.pt")
    torch.save(narrow_cnn(), tmp_path / "other_model.pt")
    return {k: str(tmp_path / f"{k}.pt") for k in ("model", "grown", "folded", "other", "other_model")}


def test_the_origin_is_recorded_once_and_carried_through_passes_fold_files_and_onnx(tmp_path):
    gm, grown = grow(small_cnn())
    origin = structure_fingerprint(gm)
    assert grown.meta["graphgrow"][ORIGIN_KEY] == origin != structure_fingerprint(grown)
    assert gg.fold(grown).gm.meta["graphgrow"][ORIGIN_KEY] == origin
    gg.save_model(grown, tmp_path / "g.pt")
    assert gg.load_model(tmp_path / "g.pt").module.meta["graphgrow"][ORIGIN_KEY] == origin
    proto = gg.export_onnx(grown, SHAPE, tmp_path / "g.onnx")
    assert {p.key: p.value for p in proto.metadata_props}["graphgrow.origin"] == origin
    assert "origin" not in gm.meta["graphgrow"], "the input model must stay untouched"


def test_training_between_growth_events_does_not_change_the_lineage(tmp_path):
    model = small_cnn()
    torch.save(small_cnn(), tmp_path / "untrained.pt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 3, 32, 32)).sum().backward()
    opt.step()
    _, grown = grow(model)
    gg.save_model(grown, tmp_path / "grown.pt")
    report = workflow.diff(str(tmp_path / "untrained.pt"), str(tmp_path / "grown.pt"))
    assert report["lineage"] == "origin" and report["passes"] == ["deepen", "grow_width"]


def test_diff_follows_one_lineage_in_order(files):
    report = workflow.diff(files["model"], files["folded"])
    assert report["passes"] == ["deepen", "grow_width", "fold"] and report["lineage"] == "origin"
    assert workflow.diff(files["grown"], files["folded"])["passes"] == ["fold"]
    with pytest.raises(InputError, match="not the other way round") as e:
        workflow.diff(files["folded"], files["grown"])
    assert "swap them" in e.value.hint


@pytest.mark.parametrize(
    "a, b, message",
    [
        ("other_model", "grown", "different networks"),  # logs alone would pass: empty is the start of any log
        ("model", "other", "different networks"),
        ("other", "grown", "not of one lineage"),  # the records differ (parameter counts), so the logs already tell
    ],
)
def test_diff_refuses_different_networks(files, a, b, message):
    with pytest.raises(InputError, match=message):
        workflow.diff(files[a], files[b])


def test_replay_onto_a_model_part_of_the_way_applies_only_the_rest(files, tmp_path):
    out = tmp_path / "again.pt"
    report = workflow.replay(files["grown"], files["folded"], str(out))
    assert [p["name"] for p in report["passes"]] == ["fold"]
    want = gg.load_model(files["folded"]).module.state_dict()
    got = gg.load_model(out).module.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize(
    "model, grown, message",
    [
        ("other_model", "grown", "different network"),
        ("folded", "grown", "not the start of that one"),
        ("grown", "grown", "nothing to replay"),
    ],
)
def test_replay_refuses_a_model_not_on_the_way(files, tmp_path, model, grown, message):
    with pytest.raises(InputError, match=message):
        workflow.replay(files[model], files[grown], str(tmp_path / "x.pt"))
    assert not (tmp_path / "x.pt").exists()


def test_replay_from_onnx_checks_the_origin_too(files, tmp_path):
    grown = gg.load_model(files["grown"]).module
    gg.export_onnx(grown, SHAPE, tmp_path / "g.onnx")
    with pytest.raises(InputError, match="different network"):
        workflow.replay(files["other_model"], str(tmp_path / "g.onnx"), str(tmp_path / "x.pt"))
    report = workflow.replay(files["model"], str(tmp_path / "g.onnx"), str(tmp_path / "y.pt"))
    assert [p["name"] for p in report["passes"]] == ["deepen", "grow_width"]


def _rewrite_metadata(path, key, value):
    proto = onnx.load(str(path))
    entry = next((p for p in proto.metadata_props if p.key == key), None) or proto.metadata_props.add()
    entry.key, entry.value = key, value
    onnx.save(proto, str(path))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("graphgrow.origin", "sha256:not-hex; rm -rf /", "origin fingerprint is malformed"),
        ("graphgrow.mutation_log", "[" * 100_000, "not readable JSON"),
        (
            "graphgrow.mutation_log",
            json.dumps([{"pass": "deepen", "args": {"x": [[[[[[[[[[[[[[1]]]]]]]]]]]]]]}}]),
            "nested too deeply",
        ),
        ("graphgrow.mutation_log", json.dumps({"pass": "deepen"}), "malformed"),
    ],
)
def test_hostile_onnx_metadata_is_a_load_error(files, tmp_path, key, value, message):
    grown = gg.load_model(files["grown"]).module
    gg.export_onnx(grown, SHAPE, tmp_path / "g.onnx")
    _rewrite_metadata(tmp_path / "g.onnx", key, value)
    with pytest.raises(LoadError, match=message):
        workflow.replay(files["model"], str(tmp_path / "g.onnx"), str(tmp_path / "x.pt"))


@pytest.mark.parametrize("origin", [{"not": "a fingerprint"}, "sha256:" + "0" * 63, "x" * 10_000])
def test_a_malformed_origin_in_a_graphgrow_file_is_a_load_error(origin):
    payload = serialize.to_payload(grow(small_cnn())[1])
    payload["meta"][ORIGIN_KEY] = origin
    with pytest.raises(LoadError, match="origin fingerprint is malformed"):
        serialize.from_payload(payload)


def test_inspect_json_shows_the_origin(files):
    report = workflow.inspect(files["folded"])
    assert report["origin"] == structure_fingerprint(gg.trace(small_cnn(), input_shape=SHAPE))
