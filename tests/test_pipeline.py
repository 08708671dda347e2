"""Pipeline specs, the registry (with a real entry-point plugin), and the verifier catching bad passes."""

from __future__ import annotations

import dataclasses
import operator
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import pytest
import torch
from conftest import assert_same_snapshot, run_cli, snapshot
from torch import nn

import graphgrow as gg
from graphgrow.jobs.pipeline import coerce, make_pass, parse_spec, spec_of
from graphgrow.rewrite import Rewrite, add_module, copy_graph_module, finish, inserting_after, replace_uses

PLUGIN_DIR = Path(__file__).parent / "plugin"


def test_parse_spec_handles_nesting_dots_and_quotes():
    steps = parse_spec("grow_width(target=layer1.0.conv1,factor=2),add_residual(start=layer1,end=layer2), deepen")
    assert steps == [
        ("grow_width", {"target": "layer1.0.conv1", "factor": "2"}),
        ("add_residual", {"start": "layer1", "end": "layer2"}),
        ("deepen", {}),
    ]
    assert parse_spec("a(x='b,c')") == [("a", {"x": "'b,c'"})]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("add_residual(", "unclosed parenthesis"),
        ("add_residual)", "unbalanced ')'"),
        ("add_residual,,x", "empty pass"),
        ("add_residual(start)", "is not key=value"),
        ("add_residual(start=a,start=b)", "given twice"),
        ("9lives", "bad pass name"),
    ],
)
def test_malformed_specs(spec, message):
    with pytest.raises(gg.SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gg.build_pipeline(spec)


def test_unknown_pass_lists_the_valid_ones():
    with pytest.raises(gg.SpecError) as e:
        gg.build_pipeline("add_resdiual")
    assert "unknown pass 'add_resdiual'" in e.value.message and "add_residual" in e.value.hint


def test_unknown_argument_lists_the_valid_ones():
    with pytest.raises(gg.SpecError) as e:
        gg.build_pipeline("add_residual(begin=layer1)")
    assert "has no argument 'begin'" in e.value.message and e.value.hint == "valid arguments: start, end"


def test_types_are_coerced_and_checked():
    assert coerce("3", int, "x") == 3 and coerce("2.5", float, "x") == 2.5 and coerce("true", bool, "x") is True
    assert coerce("none", str | None, "x") is None and coerce("layer1", str | None, "x") == "layer1"
    assert coerce("'group'", Literal["group", "adapter"], "mode") == "group"
    for value, annotation, message in [
        ("two", int, "must be int"),
        ("maybe", bool, "must be bool"),
        ("fast", Literal["group", "adapter"], "must be one of group, adapter"),
    ]:
        with pytest.raises(gg.SpecError, match=message):
            coerce(value, annotation, "arg")


def test_spec_round_trip():
    p = make_pass("add_residual", {"start": "layer1", "end": "layer2"})
    assert spec_of(p) == "add_residual(start=layer1,end=layer2)"
    assert spec_of(make_pass("add_residual", {})) == "add_residual"


def test_passes_are_frozen_dataclasses_with_defaults():
    for name in gg.pass_names():
        cls = gg.get_pass(name)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
        assert all(f.default is not dataclasses.MISSING for f in dataclasses.fields(cls)), name
        cls()  # every pass constructs with no arguments


@pytest.fixture
def plugin_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    yield
    sys.modules.pop("gg_demo_plugin", None)


def test_entry_point_plugin_is_a_first_class_pass(plugin_on_path, cnn):
    assert "scale_output" in gg.pass_names()
    result = gg.Pipeline.from_spec("scale_output(note=hello),add_residual").run(gg.trace(cnn, (1, 3, 32, 32)))
    first = result.results[0]
    assert first.notes == ["hello"] and first.preservation.trainable == {"plugin_scale": 0}
    assert [e["pass"] for e in result.log] == ["scale_output", "add_residual"]


def test_plugin_shows_in_the_cli(plugin_on_path):
    proc = run_cli("passes", env={"PYTHONPATH": str(PLUGIN_DIR)})
    assert proc.returncode == 0
    assert "scale_output" in proc.stdout and "add_residual" in proc.stdout


# --- the verifier catches passes that break the promise --------------------------------------------


def _register(cls):
    gg.register_pass(cls)
    return cls


@_register
@dataclass(frozen=True)
class _ChangesFunction(gg.Pass):
    """Adds a non-zero constant: not function-preserving."""

    name: ClassVar[str] = "test_changes_function"

    def apply(self, gm, generator):
        gm = copy_graph_module(gm)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        last = out.args[0]
        with inserting_after(last):
            bumped = gm.graph.call_function(operator.add, (last, 0.5))
        replace_uses(last, bumped, keep=[bumped])
        return Rewrite(finish(gm))


@_register
@dataclass(frozen=True)
class _DeadBranch(gg.Pass):
    """New path with zero incoming AND zero outgoing weights: exact but never learns."""

    name: ClassVar[str] = "test_dead_branch"

    def apply(self, gm, generator):
        gm = copy_graph_module(gm)
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        out = next(n for n in gm.graph.nodes if n.op == "output")
        last = out.args[0]
        a, b = nn.Linear(20, 8), nn.Linear(8, 5)
        for lin in (a, b):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        na, nb = add_module(gm, "dead_in", a), add_module(gm, "dead_out", b)
        with inserting_after(last):
            h = gm.graph.call_module(na, (x,))
            r = gm.graph.call_function(torch.relu, (h,))
            o = gm.graph.call_module(nb, (r,))
            s = gm.graph.call_function(operator.add, (last, o))
        replace_uses(last, s, keep=[s])
        return Rewrite(finish(gm))


@_register
@dataclass(frozen=True)
class _MutatesInput(gg.Pass):
    """Scales a weight of its input in place (forbidden)."""

    name: ClassVar[str] = "test_mutates_input"

    def apply(self, gm, generator):
        with torch.no_grad():
            next(gm.parameters()).mul_(1.0)
        return Rewrite(copy_graph_module(gm))


def _on_the_output(gm, method: str, *args) -> Rewrite:
    """A copy of `gm` whose output goes through `output.method(*args)`."""
    gm = copy_graph_module(gm)
    last = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    with inserting_after(last):
        v = gm.graph.call_method(method, (last, *args))
    replace_uses(last, v, keep=[v])
    return Rewrite(finish(gm))


@_register
@dataclass(frozen=True)
class _BakesBatch(gg.Pass):
    """Reshapes with the example batch size baked in."""

    name: ClassVar[str] = "test_bakes_batch"

    def apply(self, gm, generator):
        return _on_the_output(gm, "reshape", 2, 5)


@_register
@dataclass(frozen=True)
class _MixesExamples(gg.Pass):
    """Rolls the outputs along the batch: each example gets its neighbour's (the same at batch 1)."""

    name: ClassVar[str] = "test_mixes_examples"

    def apply(self, gm, generator):
        return _on_the_output(gm, "roll", 1, 0)


def _mlp_gm():
    from conftest import mlp

    return gg.trace(mlp(), (1, 20))


@pytest.mark.parametrize("examples", [1, 2])
def test_a_pass_that_mixes_the_examples_of_a_batch_is_refused(examples):
    # at example batch 1 the annotation's run is verification's second batch size; at 2, batch 3 is run
    from conftest import mlp

    gm = gg.trace(mlp(), (examples, 20))
    with pytest.raises(gg.ValidationError, match="examples in a batch influence each other"):
        gg.Pipeline.from_spec("test_mixes_examples").run(gm)


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ("test_changes_function", gg.PreservationError, "changed the model's eval-mode output"),
        ("test_dead_branch", gg.PreservationError, "get no gradient"),
        ("test_mutates_input", gg.ValidationError, "modified its input model"),
        ("test_bakes_batch", gg.ValidationError, r"node 'reshape' .* fails on inputs of shapes \[\(\d, 5\)\]"),
    ],
)
def test_verifier_rejects_broken_passes(spec, error, message):
    gm = _mlp_gm()
    before = snapshot(gm)
    with pytest.raises(error, match=message):
        gg.Pipeline.from_spec(spec).run(gm)
    if spec != "test_mutates_input":
        assert_same_snapshot(before, snapshot(gm))


def test_verification_can_be_turned_off_but_is_on_by_default():
    assert gg.Pipeline.from_spec("add_residual").verify is True
    r = gg.Pipeline.from_spec("test_changes_function", verify=False).run(_mlp_gm())
    assert r.results[0].preservation is None


def test_pipeline_seeds_each_pass_and_logs_it(cnn):
    res = gg.Pipeline.from_spec("add_residual,add_residual(start=_3,end=_8)", seed=7).run(gg.trace(cnn, (1, 3, 32, 32)))
    assert [e["seed"] for e in res.log] == [7, 8]
    assert res.log[1]["args"] == {"start": "_3", "end": "_8"}


@pytest.mark.parametrize(
    "spec, message, column",
    [
        ("add_residual,grow_width(factr=2)", "no argument 'factr'", 24),
        ("add_residual(start=_2,grow_width", "unclosed parenthesis", 12),
        ("deepen(block=big)", "must be one of", 7),
        ("deepen,,add_residual", "empty pass", 7),
        ("deepen)", "unbalanced ')'", 6),
        ("no_such_pass(x=1)", "unknown pass", 0),
        ("deepen(after)", "not key=value", 7),
    ],
)
def test_spec_errors_point_at_the_problem(spec, message, column):
    with pytest.raises(gg.SpecError, match=re.escape(message)) as info:
        gg.build_pipeline(spec)
    e = info.value
    assert e.spec == spec and e.position == column
    spec_line, caret = str(e).splitlines()[-2:]
    assert spec_line.strip() == spec and caret.index("^") - 2 == column


def test_a_failing_step_says_which_step_and_keeps_its_class():
    gm = _mlp_gm()
    with pytest.raises(gg.NotApplicable, match=r"^step 2/2 add_residual\(start=no_such_node\): ") as info:
        gg.Pipeline.from_spec("deepen,add_residual(start=no_such_node)").run(gm)
    assert info.value.exit_code == 2
