"""Growth inside a captured part of a model that cannot be captured whole (graphgrow/capture/parts.py,
jobs/part_growth.py, io/part_file.py): the part chosen by what captures and how many parameters it holds, grown under
the full check, the whole model compared before and after, saved whole, read back (nothing lost), the part exported
and checked on onnxruntime; hostile part files refused; a model where no part captures refused with the reason.
The models: tests/part_models.py (a loop over the images, mask filtering branched on its count, .item() sizes, dict and
list outputs; conv and transformer-style parts)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from graphgrow.core.errors import LoadError, TraceError
from graphgrow.graph.calls import record_calls
from graphgrow.io.load import _torch_load, load_model
from graphgrow.jobs import workflow

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
from sweep_report import reason_class  # noqa: E402

SHAPE = "1,3,16,16"
CASES = [  # (factory, pass, the part it must choose)
    ("looped_images", "grow_width", "backbone"),
    ("looped_images", "add_residual", "backbone"),
    ("nonzero_topk", "grow_width", "features"),
    ("nonzero_topk", "deepen", "features"),
    ("tokens_filtered", "grow_width", "encoder"),
    ("tokens_filtered", "insert_adapter", "encoder"),
    ("larger_uncapturable", "grow_width", "backbone"),
]


def _name(factory: str) -> str:
    return f"tests.part_models:{factory}"


def _eval_out(model: torch.nn.Module) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    torch.manual_seed(5)
    x = torch.randn(1, 3, 16, 16)
    model.eval()
    with torch.no_grad():
        return [t for t in tree_flatten(model(x))[0] if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("factory,pass_name,part", CASES)
def test_grown_inside_part_saved_reloaded_exported(tmp_path, factory, pass_name, part):
    out, onnx = tmp_path / "g.pt", tmp_path / "g.onnx"
    report = workflow.mutate(
        _name(factory), [pass_name], out=str(out), onnx_out=str(onnx), check=True, input_shape=SHAPE
    )
    assert report["part"]["path"] == part
    assert "cannot capture" in report["part"]["why_whole_not_captured"]
    assert report["preservation"]["eval_ok"] and report["preservation"]["train_ok"]
    assert report["preservation"]["trainable_ok"] and report["preservation"]["verified_passes"] == 1
    assert report["whole_check"]["passed"] and report["whole_check"]["part"]["values"] > 0
    assert report["equivalence"]["passed"], report["equivalence"]
    assert "the ONNX file is the grown part" in report["onnx_note"]
    assert out.exists() and onnx.exists()
    grown_params = report["passes"][0]["params_after"]
    # read back: the whole model, rebuilt by the name the user named again, the grown part in place, every weight
    loaded = load_model(str(out), factory=_name(factory))
    assert loaded.kind == "graphgrow-part" and loaded.model_name == _name(factory)
    assert len(loaded.log) == 1 and loaded.log[0]["pass"] == pass_name
    holder = loaded.module.get_submodule(part)
    assert isinstance(holder, torch.fx.GraphModule)
    assert sum(p.numel() for p in holder.parameters()) == grown_params
    stored = _torch_load(out, False, 1 << 30)["weights"]
    assert stored.keys() == loaded.module.state_dict().keys()
    assert all(torch.equal(stored[k], v) for k, v in loaded.module.state_dict().items())
    original = workflow.load_model(_name(factory)).module
    for a, b in zip(_eval_out(original), _eval_out(loaded.module), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_pass_that_does_not_apply_to_the_largest_part_goes_to_the_next():
    report = workflow.mutate(_name("head_larger"), ["add_branch"], input_shape=SHAPE, dry_run=True)
    assert report["part"]["path"] == "backbone" and report["whole_check"]["passed"]
    assert report["preservation"]["trainable_ok"]
    (skipped,) = report["part"]["larger_parts_where_the_passes_do_not_apply"]  # the head's Linear is not tried
    assert skipped.startswith("head: ") and "conv" in skipped
    assert "after 'head', where the passes do not apply" in report["part_note"]
    report = workflow.mutate(_name("head_larger"), ["grow_width"], input_shape=SHAPE, dry_run=True)
    assert report["part"]["path"] == "head"  # where the pass applies, the largest part


def test_pass_that_applies_to_no_part_is_refused_naming_the_parts():
    from graphgrow.core.errors import NotApplicable

    # the two parts hold every parameter: the pass has no place in the model (a stated impossibility in the sweep)
    with pytest.raises(NotApplicable) as e:
        workflow.mutate(_name("head_larger"), ["grow_heads"], input_shape=SHAPE, dry_run=True)
    said = e.value.message
    assert said.startswith("in every part of the model that holds parameters ('head', 'backbone': all ") and (
        "attention" in said
    )
    assert reason_class(said) == "no place"
    # a parameter outside every part (the model's own gain): said of the parts only, never of the model
    with pytest.raises(NotApplicable) as e:
        workflow.mutate(_name("head_larger_scaled"), ["grow_heads"], input_shape=SHAPE, dry_run=True)
    said = e.value.message
    assert said.startswith("in the part 'head' and 1 more that capture (no other part captures); 4 of the model's ")
    assert "parameters lie outside the parts that capture: " in said and "attention" in said
    assert reason_class(said) == "cannot capture"
    # a head called once per feature level is no part, but the pass has no place in it either (asked on its capture)
    with pytest.raises(NotApplicable) as e:
        workflow.mutate(_name("shared_head"), ["grow_heads"], input_shape=SHAPE, dry_run=True)
    said = e.value.message
    assert said.startswith("in every part of the model that holds parameters ('backbone'; and the modules 'head', ")
    assert reason_class(said) == "no place"


def test_part_file_of_own_factory_needs_the_name_again_or_trust(tmp_path):
    out = tmp_path / "g.pt"
    workflow.mutate(_name("looped_images"), ["grow_width"], out=str(out), input_shape=SHAPE)
    with pytest.raises(LoadError, match="not a zoo model"):
        load_model(str(out))
    with pytest.raises(LoadError, match="not a zoo model"):
        load_model(str(out), factory=_name("nonzero_topk"))  # another name is not the stored one
    assert load_model(str(out), trust=True).kind == "graphgrow-part"


def test_grown_again_from_the_part_file(tmp_path):
    first, second = tmp_path / "g.pt", tmp_path / "g2.pt"
    workflow.mutate(_name("looped_images"), ["grow_width"], out=str(first), input_shape=SHAPE)
    report = workflow.mutate(str(first), ["add_residual"], out=str(second), trust=True)
    assert report["part"]["path"] == "backbone" and report["whole_check"]["passed"]
    loaded = load_model(str(second), trust=True)
    assert [e["pass"] for e in loaded.log] == ["grow_width", "add_residual"]


def test_cli_says_which_part_and_why(tmp_path):
    from click.testing import CliRunner

    from graphgrow.cli import main

    res = CliRunner().invoke(
        main,
        ["mutate", _name("tokens_filtered"), "--pass", "grow_width", "--input-shape", SHAPE, "--onnx",
         str(tmp_path / "t.onnx"), "-o", str(tmp_path / "t.pt"), "--check"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "growing inside the part 'encoder'" in text and "the whole model cannot be captured" in text
    assert "the ONNX file is the grown part 'encoder'" in text
    assert "whole model before and after (eval mode" in text


def test_no_part_captures_is_refused_with_the_reason():
    with pytest.raises(TraceError) as e:
        workflow.mutate(_name("no_part"), ["grow_width"], input_shape=SHAPE, dry_run=True)
    assert "cannot be captured whole" in e.value.message and "no part of it captures" in e.value.message
    assert "called 2 times" not in e.value.message or "conv" in e.value.message


def test_candidates_called_once_on_tensors_largest_first():
    from graphgrow.capture.parts import candidates, find_calls
    from graphgrow.graph.inputs import plain_spec

    model = workflow.load_model(_name("no_part")).module
    found, skipped = candidates(model, find_calls(model, plain_spec([2, 3, 16, 16])))
    assert found == [] and skipped == [["conv", "it is called 4 times"]]
    model = workflow.load_model(_name("larger_uncapturable")).module
    found, _ = candidates(model, find_calls(model, plain_spec([1, 3, 16, 16])))
    assert [f[0] for f in found][:2] == ["post", "backbone"]  # post is larger; it does not capture


def test_record_calls_removes_its_hooks():
    model = workflow.load_model(_name("looped_images")).module
    calls, _ = record_calls(model, lambda m: m(torch.randn(1, 3, 16, 16)))
    assert calls["backbone"].count == 1 and calls["score"].count == 1
    assert all(not m._forward_pre_hooks for m in model.modules())


# ---------------------------------------------------------------- hostile part files


@pytest.fixture(scope="module")
def part_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("part") / "g.pt"
    workflow.mutate(_name("looped_images"), ["grow_width"], out=str(out), input_shape=SHAPE)
    return out


def _edited(part_file, tmp_path, **changes):
    obj = _torch_load(part_file, False, 1 << 30)
    for key, value in changes.items():
        if callable(value):
            value(obj)
        else:
            obj[key] = value
    path = tmp_path / "hostile.pt"
    torch.save(obj, path)
    return path


@pytest.mark.parametrize(
    "model",
    [
        "tests.part_canary:make",  # a module of the user's kind: importing it would run it
        "os:system",
        "torch:load",
        "graphgrow.io.load:load_model",
        "torchvision.models:get_model",
        "timm:resnet18(pretrained_cfg_overlay={'file': 'x.pth'})",
        "torchvision:resnet18(weights='x.pt')",
        "nonsense",
    ],
)
def test_hostile_model_name_refused(part_file, tmp_path, model):
    sys.modules.pop("tests.part_canary", None)
    os.environ.pop("GRAPHGROW_PART_CANARY", None)
    path = _edited(part_file, tmp_path, model=model)
    with pytest.raises(LoadError):
        load_model(str(path), factory=_name("looped_images"))
    assert "tests.part_canary" not in sys.modules and "GRAPHGROW_PART_CANARY" not in os.environ


@pytest.mark.parametrize("part", ["__class__", "backbone.__dict__", "", "a..b", "forward", "score.weight", "nope", 3])
def test_hostile_part_path_refused(part_file, tmp_path, part):
    path = _edited(part_file, tmp_path, part=part)
    with pytest.raises(LoadError):
        load_model(str(path), factory=_name("looped_images"))


def test_zoo_model_without_that_part_refused(part_file, tmp_path):
    path = _edited(part_file, tmp_path, model="torchvision:resnet18(num_classes=3)")
    with pytest.raises(LoadError, match="no submodule 'backbone'"):
        load_model(str(path))  # a zoo name needs no trust: its builder is an allowed one, and it lacks the part


def test_hostile_graph_and_weights_refused(part_file, tmp_path):
    def call_os(obj):
        rec = next(r for r in obj["graph"]["nodes"] if r["op"] == "call_module")
        rec["op"], rec["target"] = "call_function", "os.system"

    with pytest.raises(LoadError, match="os.system"):
        load_model(str(_edited(part_file, tmp_path, _=call_os)), factory=_name("looped_images"))

    def drop_weight(obj):
        obj["weights"].pop(next(iter(obj["weights"])))

    with pytest.raises(LoadError, match="weights do not fit"):
        load_model(str(_edited(part_file, tmp_path, _=drop_weight)), factory=_name("looped_images"))
    with pytest.raises(LoadError, match="does not run on its stored input"):
        load_model(str(_edited(part_file, tmp_path, inputs=[{"name": "x", "shape": [1, 3, 8]}])), trust=True)

    def other_input(obj):  # the part no longer receives what it was grown for
        obj["inputs"][0]["shape"] = [1, 3, 32, 32]

    with pytest.raises(LoadError, match="not called once on the input it was grown for"):
        load_model(str(_edited(part_file, tmp_path, _=other_input)), factory=_name("looped_images"))
