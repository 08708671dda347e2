"""Property-based fuzzing: random architectures × random pipelines.

Every case must either verify (preservation, trainability, shapes — the pipeline's own
checks) or raise a typed GraphgrowError, and the input model must be bit-identical
afterwards. GRAPHGROW_FUZZ_EXAMPLES sets the count (`make fuzz` runs a long campaign).
"""

from __future__ import annotations

import copy
import os
import time
from collections import Counter

import pytest
import torch
from conftest import assert_same_snapshot, randomize_bn, snapshot, trained_looking
from fuzz_models import IN_CH, SIZE, FuzzNet, architectures, pass_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphgrow as gg

EXAMPLES = int(os.environ.get("GRAPHGROW_FUZZ_EXAMPLES", "60"))
STATS: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def report_campaign():
    start = time.perf_counter()
    yield
    print(
        f"\nfuzz: {sum(STATS.values())} cases in {time.perf_counter() - start:.1f}s: "
        + ", ".join(f"{k} {v}" for k, v in sorted(STATS.items()))
    )


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 100,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(arch=architectures, data=st.data())
def test_random_pipelines_verify_or_raise_typed_errors(arch, data):
    ops, head = arch
    torch.manual_seed(0)
    model = randomize_bn(FuzzNet(ops, head))
    try:
        gm = gg.trace(model, (1, IN_CH, SIZE, SIZE))
        gg.annotate(gm, (1, IN_CH, SIZE, SIZE))
    except gg.GraphgrowError:
        STATS["model rejected"] += 1
        return
    nodes = [n.name for n in gm.graph.nodes if n.op not in ("output",)]
    modules = [n for n, _ in gm.named_modules() if n]
    layers = [
        n.target
        for n in gm.graph.nodes
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), (torch.nn.Conv2d, torch.nn.Linear))
    ]
    specs = data.draw(st.lists(pass_spec(nodes, modules, layers), min_size=1, max_size=3), label="pipeline")
    before = snapshot(gm)
    try:
        result = gg.Pipeline.from_spec(",".join(specs)).run(gm)
    except gg.GraphgrowError as e:
        STATS[type(e).__name__] += 1
        assert str(e) and "\n" not in e.message, e.message  # one line, says what is wrong
        if isinstance(e, (gg.PreservationError, gg.ValidationError)):
            pytest.fail(f"verification failed (a bug in a pass): {specs}: {e}")
    else:
        STATS["verified"] += 1
        for r in result.results:
            if r.preservation is not None and r.exact:
                assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok
        assert result.results[-1].gm is not gm
        # fold must be exact (eval mode) on whatever the pipeline grew, once gates and statistics look trained
        deployed = gg.fold(trained_looking(copy.deepcopy(result.gm)))
        assert deployed.preservation is None or deployed.preservation.eval.ok
        STATS["folded"] += 1
    assert_same_snapshot(before, snapshot(gm))


@pytest.mark.parametrize(
    "ops, head, spec",
    [
        # add_branch beside a conv whose output feeds BatchNorm (train mode): the branch's last BN bias is
        # cancelled by the next normalisation. Redundant, not dead: reported, not refused.
        (
            [("conv", 2, 1, 1, "full"), ("cat", 2, 1), ("bn",), ("bn",)],
            ("gap", False),
            "add_branch(op=conv3x3,count=1)",
        ),
        # deepen after the logits: the ReLU block could be silent on the whole check batch (now paired units).
        ([("conv", 2, 1, 1, "full")], ("flat", False), "deepen(after=fc)"),
    ],
)
def test_cases_the_fuzzer_found(ops, head, spec):
    torch.manual_seed(0)
    gm = gg.trace(randomize_bn(FuzzNet(ops, head)), (1, IN_CH, SIZE, SIZE))
    r = gg.Pipeline.from_spec(spec).run(gm).results[0]
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok
    if spec.startswith("add_branch"):  # its train-mode gradient is zero or rounding noise, depending on the input
        bias = "branch_conv3x3.2.bias"
        assert bias in r.preservation.cancelled or bias in r.preservation.trainable
        assert (bias in r.preservation.cancelled) == any("cancels them in train mode" in n for n in r.notes)


def test_a_group_assembled_by_cat_grows_through_the_cats_last_input():
    """Found by the fuzzer: cat → residual block; growing the block's conv needs new cat channels, which the
    cat's last input provides (the growth follows the cat's link backwards)."""
    torch.manual_seed(0)
    gm = gg.trace(randomize_bn(FuzzNet([("cat", 1, 1), ("res",)], ("gap", False))), (1, IN_CH, SIZE, SIZE))
    for target in ("layers.1.0", "layers.0.0"):
        r = gg.Pipeline.from_spec(f"grow_width(target={target})").run(gm).results[0]
        assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok


def test_growing_after_a_dead_relu_is_refused_not_blamed_on_the_pass():
    """Found by the fuzzer: a ReLU that is zero on every check input leaves a deepened block without gradient.
    The model keeps it from learning, not the pass: NotApplicable (exit 2), not PreservationError."""
    torch.manual_seed(0)
    gm = gg.trace(
        randomize_bn(FuzzNet([("cat", 1, 1), ("conv", 2, 1, 1, "full"), ("act", "relu")], ("gap", False))),
        (1, IN_CH, SIZE, SIZE),
    )
    with pytest.raises(gg.NotApplicable, match="zero on every check input"):
        gg.Pipeline.from_spec("deepen").run(gm)


def test_growing_where_no_gradient_reaches_is_refused_not_blamed_on_the_pass():
    """Found by the fuzzer: an adapter on the input of a model whose last ReLU is dead on the check inputs
    gets no gradient, and neither would anything else there. NotApplicable, not PreservationError."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(IN_CH, 4, 1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 3),
    )
    with torch.no_grad():  # the ReLU is dead for any input of normal size
        model[0].weight.mul_(1e-3)
        model[0].bias.fill_(-100.0)
    gm = gg.trace(model, (1, IN_CH, SIZE, SIZE))
    x = next(n.name for n in gm.graph.nodes if n.op == "placeholder")
    with pytest.raises(gg.NotApplicable, match=f"does not depend on '{x}'|zero on every check input"):
        gg.Pipeline.from_spec(f"insert_adapter(after={x})").run(gm)


def test_a_vanishing_gradient_counts_as_none_reaching_the_place():
    """The sweep's untrained EfficientNet-B7 passes 1e-28 of its output's gradient to its middle: a layer grown
    there gets exactly none after the check's steps. The model keeps it from learning (NotApplicable), and a
    gradient below float32's eps² of the output's is as good as none (deaf_points); a normal one is heard."""
    from graphgrow.verify.verify import deaf_points

    class Vanishing(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale
            self.a, self.b, self.skip = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.b(h) * self.scale + self.skip(x)

    for scale, deaf in ((1e-20, True), (1e-3, False)):
        old = gg.trace(Vanishing(scale), (2, 4))
        p = gg.Pipeline.from_spec("deepen(after=relu)")
        p.verify = False
        new = p.run(old).gm
        dead = [n for n, _ in new.named_parameters() if "deepen" in n and not n.endswith("gate")]
        x = torch.randn(2, 4)
        assert deaf_points(old, new, dead, x, {n.name for n in old.graph.nodes}) == (["relu"] if deaf else [])
