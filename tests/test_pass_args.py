"""A pass declares each argument once (arg(): type, default, help, allowed values) and what it requires and ensures.

Rules over every registered pass (a pass added later is covered too), the checks at parse time (a SpecError, exit 2,
before the model file is opened), the plain functions taking their defaults from the declaration, and a third-party
pass using the same declarations."""

from __future__ import annotations

import dataclasses
import inspect
import operator
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest
import torch
from conftest import run_cli
from torch import nn

import graphgrow as gg
from graphgrow.rewrite import ADDS_PARAMETERS, Guarantee, Requirement, begin, finish, param_count, pass_function
from graphgrow.rewrite.arguments import PassFunction, admits_none

PASSES = {name: cls for name, cls in gg.all_passes().items() if isinstance(cls, type)}
BUILT_IN = {name: cls for name, cls in PASSES.items() if cls.__module__.startswith("graphgrow.passes")}


def test_every_built_in_pass_is_found():
    assert set(BUILT_IN) >= {
        "add_residual",
        "grow_width",
        "insert_adapter",
        "add_branch",
        "remove_branch",
        "deepen",
        "grow_hidden",
        "grow_heads",
        "fold",
    }


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_the_plain_function_declares_no_default(name):
    """The rule: a pass function takes its arguments' defaults from the Pass (`@pass_function`); a default written in
    its signature would be a second declaration that can drift from the first."""
    cls = BUILT_IN[name]
    function = cls.function
    assert isinstance(function, PassFunction) and function.declared_by is cls, (
        f"{name}: decorate its function with @pass_function (graphgrow.rewrite) so the Pass declares its arguments"
    )
    own = inspect.signature(function.raw).parameters
    fields = [f.name for f in dataclasses.fields(cls)]
    assert [p for p in own if p in fields] == fields, f"{name}: the function takes every argument, in declaration order"
    doubled = [p for p in fields if own[p].default is not inspect.Parameter.empty]
    assert not doubled, f"{name}'s function gives {doubled} a default: declare it once, in the Pass's arg()"
    # what callers see (help(), IDEs): the declared defaults
    shown = inspect.signature(function).parameters
    assert {f.name: f.default for f in dataclasses.fields(cls)} == {p: shown[p].default for p in fields}


@pytest.mark.parametrize("name", sorted(PASSES))
def test_every_argument_is_declared_with_arg_and_its_default_is_allowed(name):
    cls = PASSES[name]
    hints = typing.get_type_hints(cls)
    allowed = cls.argument_allowed()
    for f in dataclasses.fields(cls):
        assert "help" in f.metadata and f.metadata["help"], f"{name}.{f.name}: declare it with arg(default, help)"
        if f.default is None and admits_none(hints[f.name]):
            continue
        assert allowed[f.name].problem(f.default) is None, f"{name}.{f.name}: its default {f.default!r} is not allowed"
    cls()  # the declared defaults construct the pass


BAD = [
    ("grow_width(factor=1e9)", "grow_width(factor=...) must be in (0, 16], got 1000000000.0", "factor"),
    ("grow_width(factor=0)", "grow_width(factor=...) must be in (0, 16], got 0.0", "factor"),
    ("grow_width(to=0)", "grow_width(to=...) must be ≥ 1, got 0", "to"),
    ("grow_width(mode=widest)", "must be one of group, adapter, got 'widest'", "mode"),
    ("add_branch(count=100000)", "add_branch(count=...) must be in [1, 16], got 100000", "count"),
    ("add_branch(op=conv7x7)", "must be one of conv3x3", "op"),
    ("insert_adapter(out_channels=-3)", "insert_adapter(out_channels=...) must be ≥ 1, got -3", "out_channels"),
    ("grow_heads(by=0)", "grow_heads(by=...) must be ≥ 1, got 0", "by"),
    ("grow_hidden(to=0)", "grow_hidden(to=...) must be ≥ 1, got 0", "to"),
    ("deepen(attention=sideways)", "must be one of auto, causal, bidirectional", "attention"),
    ("add_branch(init=gradmax,count=2)", "add_branch(count=...): init=gradmax aims one branch at a time", "count"),
]


@pytest.mark.parametrize("spec, message, argument", BAD)
def test_a_bad_value_is_a_spec_error_at_parse_time(spec, message, argument):
    with pytest.raises(gg.SpecError) as e:
        gg.build_pipeline(spec)
    assert message in e.value.message and e.value.argument == argument
    assert e.value.position == spec.index(argument + "=")  # the caret points at the argument


@pytest.mark.parametrize("spec, message", [(s, m) for s, m, _ in BAD[:1] + BAD[4:5]])
def test_the_cli_refuses_a_bad_value_before_opening_the_model(tmp_path, spec, message):
    missing = tmp_path / "no_such_model.pt"  # never created: had the CLI opened it, the error would name the file
    proc = run_cli("mutate", str(missing), "--pass", spec, "--input-shape", "1,3,32,32", "-o", str(tmp_path / "out.pt"))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "no_such_model" not in proc.stderr, proc.stderr


def test_the_same_checks_hold_in_python():
    from graphgrow.passes.add_branch import AddBranch, add_branch

    with pytest.raises(gg.SpecError, match=r"add_branch\(count=\.\.\.\) must be in \[1, 16\], got 17"):
        AddBranch(count=17)
    with pytest.raises(gg.SpecError, match="must be a number in"):
        AddBranch(count="many")  # type: ignore[arg-type]  # a wrong type reaches the range check from Python
    with pytest.raises(gg.SpecError, match="must be in"):  # the plain function: the same declaration
        add_branch(gg.trace(nn.Sequential(nn.Conv2d(3, 4, 3)), (1, 3, 8, 8)), count=0)


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    ).eval()


def test_good_values_still_work_and_the_plain_function_takes_the_declared_defaults():
    from graphgrow.passes.grow_width import grow_width

    gm = gg.trace(cnn(), (1, 3, 16, 16))
    r = gg.Pipeline.from_spec("grow_width(target=3,factor=16)").run(gm).results[0]
    assert "8 → 128" in r.targets["target"]
    rw = grow_width(gm, target="3")  # factor, mode, init: the defaults GrowWidth declares
    assert "8 → 16" in rw.targets["target"]
    assert gg.build_pipeline("grow_width(factor=0.5e1,to=None,mode=adapter)")[0].factor == 5.0
    import pickle

    assert pickle.loads(pickle.dumps(grow_width)) is grow_width  # by reference, as a plain function (search workers)


def test_graphgrow_passes_shows_what_each_argument_allows_and_the_contract():
    import json

    proc = run_cli("passes", "--json")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    factor = next(a for a in found["grow_width"]["args"] if a["name"] == "factor")
    assert factor["allowed"] == "in (0, 16]" and factor["default"] == 2.0
    assert found["grow_heads"]["requires"] == [
        "an attention (F.scaled_dot_product_attention, or softmax(q @ kᵀ) @ v written eagerly)"
    ]
    assert found["remove_branch"]["ensures"] == ["removes parameters"] and found["fold"]["ensures"] == []
    text = run_cli("passes").stdout
    assert (
        "count: int, in [1, 16] = 1" in text
        and "(requires a branch merge (add_branch's); ensures it removes parameters)" in text
    )


def test_requires_refuses_before_any_work_and_ensures_is_checked():
    from graphgrow.passes.add_branch import RemoveBranch, remove_branch
    from graphgrow.passes.grow_heads import GrowHeads

    gm = gg.trace(cnn(), (1, 3, 16, 16))
    with pytest.raises(gg.NotApplicable, match="no branch merge to remove from"):
        RemoveBranch()(gm)
    with pytest.raises(gg.NotApplicable, match="no branch merge to remove from"):
        remove_branch(gm)  # the plain function checks the same requirement
    with pytest.raises(gg.NotApplicable, match="no scaled_dot_product_attention"):
        GrowHeads()(gm)
    assert [r.name for r in GrowHeads.requires] == [
        "an attention (F.scaled_dot_product_attention, or softmax(q @ kᵀ) @ v written eagerly)"
    ]
    assert ADDS_PARAMETERS in gg.get_pass("grow_width").ensures and not gg.get_pass("fold").ensures


# --- a third-party pass -----------------------------------------------------------------------------------


@pass_function
def scale_by(gm, factor: float, where: str, generator=None) -> gg.Rewrite:
    gm, generator = begin(gm, generator)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    last = out.args[0]
    with gm.graph.inserting_before(out):
        scaled = gm.graph.call_function(operator.mul, (last, factor))
    out.args = (scaled,)
    return gg.Rewrite(finish(gm), {"factor": factor, "where": where})


def _even(value: float) -> str | None:
    """an even number"""
    return None if float(value) % 2 == 0 else "must be an even number"


NO_NEW_PARAMETERS = Guarantee(
    "adds no parameters",
    lambda before, after: None if param_count(after) <= param_count(before) else "it added parameters",
)


@dataclass(frozen=True)
class ScaleBy(gg.Pass):
    """Multiply the output by a constant (changes the function: a test of the declarations only)."""

    name: ClassVar[str] = "test_scale_by"
    grows: ClassVar[bool] = False
    function = scale_by
    requires = (
        Requirement(
            "a Linear layer",
            lambda gm: any(isinstance(m, nn.Linear) for m in gm.modules()),
            "the model has no Linear layer",
            "give a model with one",
        ),
    )
    ensures = (NO_NEW_PARAMETERS,)
    factor: float = gg.arg(2.0, "the constant", low=-8, below=8, check=_even)
    where: Literal["output"] = gg.arg("output", "where to scale")


@pytest.fixture
def registered(monkeypatch):
    from graphgrow.jobs import registry

    monkeypatch.setitem(registry._local, ScaleBy.name, ScaleBy)  # this test's process only, undone after it


def test_a_third_party_pass_declared_with_arg(registered):
    assert [p.name for p in gg.build_pipeline("test_scale_by(factor=4)")] == ["test_scale_by"]
    for spec, message in [
        ("test_scale_by(factor=8)", "must be in [-8, 8), got 8.0"),
        ("test_scale_by(factor=3)", "must be an even number, got 3.0"),
        ("test_scale_by(where=input)", "must be one of output, got 'input'"),
    ]:
        with pytest.raises(gg.SpecError, match=message.replace("(", r"\(").replace("[", r"\[").replace(")", r"\)")):
            gg.build_pipeline(spec)
    assert ScaleBy.argument_allowed()["factor"].describe() == "in [-8, 8), an even number"
    gm = gg.trace(cnn(), (1, 3, 16, 16))
    rw = scale_by(gm)  # the declared defaults
    assert rw.targets == {"factor": 2.0, "where": "output"}
    x = torch.randn(2, 3, 16, 16)
    assert torch.allclose(rw.gm(x), 2 * gm(x))
    r = gg.Pipeline.from_spec("test_scale_by(factor=-2)", verify=False).run(gm).results[0]
    assert r.args == {"factor": -2.0, "where": "output"}
    with pytest.raises(gg.NotApplicable, match="no Linear layer"):
        ScaleBy()(gg.trace(nn.Sequential(nn.Conv2d(3, 4, 3)), (1, 3, 8, 8)))


def test_a_broken_guarantee_is_a_validation_error():
    @dataclass(frozen=True)
    class Claims(gg.Pass):
        """Claims to add parameters but adds none."""

        name: ClassVar[str] = "test_claims"
        grows: ClassVar[bool] = False
        ensures = (ADDS_PARAMETERS,)

        def apply(self, gm, generator):
            return scale_by.raw(gm, 2.0, "output", generator)

    with pytest.raises(gg.ValidationError, match="broke its guarantee 'adds parameters'"):
        Claims()(gg.trace(cnn(), (1, 3, 16, 16)), verify_result=False)


def test_adds_parameters_counts_the_parameters_the_graph_uses():
    """A torch.export capture holds modules the forward never calls (CLIP's post_layernorm under its image
    classification head); an edit drops them (fx_edit.finish). A growth beside a larger unused one still adds
    parameters, counted over what the graph reads (sweep: CLIP deepen was 'broke its guarantee')."""
    gm = gg.trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), (2, 4))
    gm.add_submodule("spare", nn.LayerNorm(1000))  # as the export capture keeps it: held, never called
    r = gg.Pipeline.from_spec("grow_width(target=0,to=10)").run(gm)
    assert r.results[0].preservation.eval.ok and r.gm.get_submodule("0").out_features == 10
    assert not hasattr(r.gm, "spare")
