"""Defaults that respect the main path (issue 25, item 3): a head that only runs in train mode (an
auxiliary classifier) is never a default place, and a model too small for the parameter budget gets
the smallest main-path place, with a report that says so."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import ROOT
from torch import nn

import graphgrow as gg
from graphgrow.analysis.deployed import deployed_nodes, train_only_nodes
from graphgrow.analysis.stages import main_path
from graphgrow.graph.fx_edit import copy_graph_module
from graphgrow.graph.graph_meta import trace_report

sys.path.insert(0, str(ROOT / "examples"))
import darts_net as dn  # noqa: E402

GROWING = ("grow_width", "add_branch", "add_branch(op=sepconv3x3)", "add_residual", "deepen", "insert_adapter")


PLACES = ("target", "span", "start", "end", "after")  # where a pass put its change ("rebuilt" may name a consumer)


def _chosen_places(r: gg.PassResult) -> str:
    return " ".join(str(r.targets.get(k, "")) for k in PLACES)


def _pass(spec: str) -> gg.Pass:
    name, args = gg.parse_spec(spec)[0]
    return gg.get_pass(name)(**args)  # type: ignore[call-arg]  # string arguments are enough here


def _check_default(gm, spec: str, head: str) -> gg.PassResult | None:
    """Apply `spec` with its default place: verified and never in `head`, or refused; its candidates never
    mark a place in `head` as the default."""
    try:
        r = gg.Pipeline.from_spec(spec).run(gm).results[0]
    except gg.NotApplicable as e:
        assert head not in str(e).split(";")[0], f"{spec}: {e}"
        return None
    assert head not in _chosen_places(r) and head not in r.targets["chosen"], f"{spec}: {r.targets}"
    assert r.preservation is not None and r.params_after > r.params_before
    assert not any(c.default and head in str(c.args) for c in _pass(spec).candidates(gm)), spec
    return r


@pytest.fixture(scope="module")
def darts_train():
    gm = gg.trace(dn.small_darts(), (2, 3, 32, 32), mode="train")
    gg.annotate(gm, (2, 3, 32, 32))
    return gm


def test_the_darts_auxiliary_head_is_recorded_as_train_only_and_kept_by_save_and_load(darts_train, tmp_path):
    assert trace_report(darts_train)["train_only_modules"] == ["auxiliary_head"]
    only = train_only_nodes(darts_train)
    assert len(only) == 11 and all(
        n.meta["gg_scope"][0] == "auxiliary_head" for n in only
    )  # 9 layers, size() and view()
    assert not only & deployed_nodes(darts_train)
    gg.save_model(darts_train, tmp_path / "darts.pt")
    loaded = gg.load_model(tmp_path / "darts.pt", trust=True).module  # the cells are custom leaves
    assert trace_report(loaded)["train_only_modules"] == ["auxiliary_head"]
    assert {n.name for n in train_only_nodes(loaded)} == {n.name for n in only}
    # traced in eval mode the head is not in the graph, and nothing is recorded
    assert "train_only_modules" not in trace_report(gg.trace(dn.small_darts(), (2, 3, 32, 32)))


@pytest.mark.parametrize("spec", GROWING)
def test_no_default_place_on_darts_is_in_the_auxiliary_head(darts_train, spec):
    _check_default(darts_train, spec, "auxiliary_head")


class HeadOnlyAux(nn.Module):
    """The only convs a branch can run beside are in the train-only head (the deployed conv reads the input)."""

    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv2d(3, 8, 3, padding=1)
        self.aux = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 10),
        )
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        h = torch.relu(self.conv0(x))
        logits = self.fc(h.mean((2, 3)))
        if self.training:
            return logits, self.aux(h)
        return logits


def test_a_refusal_names_the_train_only_head_it_left_out():
    torch.manual_seed(0)
    gm = gg.trace(HeadOnlyAux(), (2, 3, 8, 8), mode="train")
    with pytest.raises(gg.NotApplicable) as e:
        gg.Pipeline.from_spec("add_branch").run(gm)
    assert "train-only aux (not in the deployed model) is never a default place" in str(e.value) and "at=" in str(
        e.value
    )
    r = gg.Pipeline.from_spec("add_branch(at=aux.2)").run(gm).results[0]  # named, it grows there
    assert "aux_2" in r.targets["span"] and r.preservation is not None


class AuxFirst(nn.Module):
    """A network of our own with a train-only head that it returns *first* in train mode, and that
    comes first in graph order and is the cheapest to grow: every old default went there."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 48, 3, padding=1), nn.BatchNorm2d(48), nn.ReLU())
        self.aux = nn.Sequential(
            nn.Conv2d(48, 4, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4, 10),
        )
        self.body = nn.Sequential(
            nn.Conv2d(48, 64, 3, stride=2, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=2, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
        )
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        h = self.stem(x)
        if self.training:
            aux = self.aux(h)
        logits = self.fc(self.body(h).mean((2, 3)))
        if self.training:
            return aux.view(aux.size(0), -1), logits
        return logits


@pytest.fixture(scope="module")
def aux_first():
    torch.manual_seed(0)
    gm = gg.trace(AuxFirst(), (2, 3, 16, 16), mode="train")
    gg.annotate(gm, (2, 3, 16, 16))
    return gm


def test_a_train_only_head_of_our_own_is_never_a_default_place(aux_first):
    assert trace_report(aux_first)["train_only_modules"] == ["aux"]
    path = {n.name for n in main_path(aux_first)}
    assert path and not any(p.startswith("aux") for p in path)  # the main path runs to the deployed logits
    only = {n.name for n in train_only_nodes(aux_first)}
    assert "view" in only  # computed from the head's output alone: train-only too
    for spec in GROWING:
        assert _check_default(aux_first, spec, "aux") is not None, spec  # every pass finds a main-path place


def test_without_the_record_everything_that_reaches_an_output_counts(aux_first):
    """A file from an older graphgrow has no train-only record: nothing is guessed (the head counts)."""
    old = copy_graph_module(aux_first)
    del old.meta["graphgrow"]["trace"]["train_only_modules"]
    assert not train_only_nodes(old)
    assert any(str(n.target).startswith("aux.") for n in deployed_nodes(old))
    old.meta["graphgrow"]["trace"]["train_only_modules"] = "aux"  # malformed (a hostile file): read as none
    assert not train_only_nodes(old)


class Tiny(nn.Module):
    """Too small for the 25% budget: every place grows it by more. The first growable layer (conv1) and
    the last branch site (conv3) are not the smallest places."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.conv3 = nn.Conv2d(4, 5, 3, padding=1)
        self.fc = nn.Linear(5, 2)

    def forward(self, x):
        x = torch.relu(self.conv3(torch.relu(self.conv2(torch.relu(self.conv1(x))))))
        return self.fc(x.mean((2, 3)))


class TinyStrided(nn.Module):
    """1×1 convs, three resolutions, one main-path tensor each: the only skips are the one-stage ones, both
    over the budget, and the preferred one (into the last stage) is not the smaller."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 1)
        self.conv2 = nn.Conv2d(4, 8, 1, stride=2)
        self.conv3 = nn.Conv2d(8, 8, 1, stride=2)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(self.conv3(self.conv2(self.conv1(x))).mean((2, 3)))


@pytest.mark.parametrize(
    "model, spec, place",
    [
        (Tiny, "grow_width", "conv3"),
        (Tiny, "add_branch", "conv2"),
        (Tiny, "deepen", "relu_2"),
        (TinyStrided, "add_residual", "conv2"),
    ],
)
def test_a_model_below_the_budget_gets_the_smallest_main_path_place_and_is_told(model, spec, place):
    torch.manual_seed(0)
    gm = gg.trace(model(), (2, 3, 8, 8))
    gg.annotate(gm, (2, 3, 8, 8))
    found = _pass(spec).candidates(gm)
    total = sum(p.numel() for p in gm.parameters())
    assert found and min(c.params for c in found) > 0.25 * total  # really too small for the budget
    default = next(c for c in found if c.default)
    assert default.params == min(c.params for c in found)
    r = gg.Pipeline.from_spec(spec).run(gm).results[0]
    assert place in _chosen_places(r), r.targets
    assert all(
        str(v).replace(".", "_") in _chosen_places(r).replace(".", "_") for v in default.args.values()
    )  # the default candidate
    assert "over budget" in r.targets["chosen"] and "smallest" in r.targets["chosen"]
    assert "over budget" in r.summary() and r.preservation is not None


class Vanishing(nn.Module):
    """An untrained stack too deep to pass its signal on, in small: the first stage's output reaches the head scaled
    by 1e-30 (below float32's eps², as through 55 EfficientNet blocks), so a layer grown there could never learn.
    That first stage end is the one place within the parameter budget; the wide last stage is over it."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.down = nn.Conv2d(4, 64, 3, stride=2, padding=1)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        y = torch.relu(self.down(self.stem(x)) * 1e-30 + 1.0)
        return self.head(y.mean((2, 3)))


class VanishingInside(Vanishing):
    """The same, scaled between the stem and the wide layer: the stem's channels are what no gradient reaches."""

    def forward(self, x):
        y = torch.relu(self.down(self.stem(x) * 1e-30 + 1.0))
        return self.head(y.mean((2, 3)))


@pytest.mark.parametrize(
    "model, spec, key, place, deaf",
    [
        (Vanishing, "deepen", "after", "relu ", "1 other stage ends"),
        (VanishingInside, "grow_width", "target", "down", "1 other layers"),
    ],
)
def test_a_default_place_the_output_does_not_hear_is_passed_over(model, spec, key, place, deaf):
    torch.manual_seed(0)
    gm = gg.trace(model().eval(), (1, 3, 16, 16))
    # deepen was refused ("the model's output does not depend on 'stem_1'"); grow_width verified at 'stem.0', whose
    # new rows then learn only through the 1e-30 (efficientnet's grow_width default was refused so)
    r = _pass(spec)(gm)
    assert str(r.targets[key]).startswith(place), r.targets
    assert f"{deaf} get a vanishing gradient from the output" in r.targets["chosen"], r.targets
