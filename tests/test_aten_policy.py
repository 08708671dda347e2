"""Issue 39: ATen operators in stored graphs, allowed by a stated principle (io/aten_policy.py), not one by one.

Whatever graphgrow captures it can save: the ops of the Hugging Face growths that were refused ("cannot save the
model") are allowed by the principle; every excluded op is refused with its class and reason; the table is what
the installed torch's metadata gives; random graphs of drawn ATen ops load either refused with the class or, when
allowed, run with no process, file write or import (an audit-hook canary)."""

from __future__ import annotations

import contextlib
import operator
import os
import sys

import pytest
import torch
from conftest import small_cnn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import fx, nn

import graphgrow as gg
from graphgrow.io import aten_policy, graph_policy, serialize
from graphgrow.io.load import load_model

EXAMPLES = int(os.environ.get("GRAPHGROW_FUZZ_EXAMPLES", "60"))
P = aten_policy.PREFIX


@pytest.mark.parametrize(
    "op",
    [
        "where.ScalarOther",
        "lift_fresh_copy.default",
        "topk.default",
        "type_as.default",
        "softplus.default",
        "unbind.int",
        "bmm.default",
        "repeat_interleave.self_int",
        "_to_copy.default",
        "div_.Tensor",
        "native_dropout.default",
        "bernoulli.p",
    ],
)
def test_what_the_hugging_face_growths_needed_is_allowed(op):
    """The six ops of the 16 "cannot save" refusals, the MoE layers' (bmm, repeat_interleave, an in-place div_),
    a core private op and random ops (as in training)."""
    assert aten_policy.refusal(P + op) is None
    graph_policy.check_function(P + op, "n")  # the loader's check passes


@pytest.mark.parametrize(
    "op, cls",
    [
        ("from_file.default", "io"),
        ("_print.default", "io"),
        ("as_strided.default", "storage"),
        ("set_.source_Storage", "storage"),
        ("resize_.default", "storage"),
        ("empty_strided.default", "storage"),
        ("add.out", "mutating"),
        ("copy_.default", None),
        ("to_sparse.default", "sparse"),
        ("quantize_per_tensor.default", "quantized"),
        ("cudnn_convolution.default", "backend"),
        ("gelu_backward.default", "backward"),
        ("_unsafe_index.Tensor", "unchecked"),
        ("_fft_c2c.default", "private"),
        ("no_such_op.default", "unknown"),
    ],
)
def test_each_excluded_class_is_refused_with_its_reason(op, cls):
    why = aten_policy.refusal(P + op)
    if cls is None:  # the in-place form of an allowed op (x.copy_(y) is x = copy(x, y))
        assert why is None
        return
    assert why is not None and f"({cls}: {aten_policy.CLASSES[cls]})" in why and op in why
    with pytest.raises(gg.LoadError, match=cls):
        graph_policy.check_function(P + op, "n")


def test_the_table_follows_from_torchs_metadata():
    """Deterministic (recomputed from scratch: the same table) and the principle holds over every overload."""
    table = dict(aten_policy.table())
    assert len(table) > 2000 and set(table.values()) <= set(aten_policy.CLASSES) | {None}
    aten_policy.table.cache_clear()
    aten_policy._classify.cache_clear()
    assert aten_policy.table() == table
    from torch._decomp import core_aten_decompositions

    decomposed = set(core_aten_decompositions())
    for name, op in aten_policy._by_name().items():
        if table[P + name] is not None:
            continue
        schema = op._schema
        assert not any(str(a.type) == "Storage" or a.name == "storage_offset" for a in schema.arguments), name
        if schema.is_mutable:  # only the first argument, as the in-place form of an allowed functional op
            assert (
                name.split(".")[0].endswith("_") and table[P + name.split(".")[0][:-1] + "." + op._overloadname] is None
            )
            assert [i for i, a in enumerate(schema.arguments) if a.alias_info and a.alias_info.is_write] == [0], name
        else:
            assert schema.returns, name
        if name.startswith("_") and not name.startswith("__"):
            assert torch.Tag.core in op.tags or op in decomposed, name
    core = [n for n, op in aten_policy._by_name().items() if torch.Tag.core in op.tags and not op._schema.is_mutable]
    allowed = sum(table[P + n] is None for n in core)
    assert allowed >= 0.9 * len(core)  # ATen's core IR is nearly all pure tensor computation


def test_a_factorys_constant_sizes_are_bounded():
    big = 1 << 13
    graph_policy.check_sizes(P + "zeros.default", ([4, 4],), {}, "n")
    graph_policy.check_sizes(P + "arange.start", (0, 10), {}, "n")
    for qualname, args in [
        ("zeros.default", ([big, big],)),
        ("randperm.default", (1 << 25,)),
        ("new_zeros.default", (None, [big, big])),
        ("arange.default", (1 << 25,)),
    ]:
        with pytest.raises(gg.LoadError, match="elements|at most"):
            graph_policy.check_sizes(P + qualname, args, {}, "n")
    with pytest.raises(gg.LoadError, match="do not fit"):
        graph_policy.check_sizes(P + "zeros.default", ([-1],), {}, "n")


def _graph(build) -> fx.GraphModule:
    """A graph of one input x (2×5) whose output is build(graph, x)."""
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(build(g, x))
    gm = fx.GraphModule(nn.Module(), g, "GraphModule")
    gm.meta["graphgrow"] = {"input_shape": [2, 5], "log": []}
    return gm


def test_a_graph_with_aten_ops_saves_loads_and_runs(tmp_path):
    aten = torch.ops.aten

    def build(g, x):
        soft = g.call_function(aten.softplus.default, (x, 1.0, 20.0))
        top = g.call_function(aten.topk.default, (soft, 2))
        return g.call_function(aten.unbind.int, (g.call_function(operator.getitem, (top, 0)), 0))

    gm = _graph(build)
    x = torch.randn(2, 5)
    gg.save_model(gm, tmp_path / "m.pt")
    loaded = load_model(tmp_path / "m.pt").module  # no --trust
    got, want = loaded(x), gm(x)
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_an_excluded_op_is_a_save_error_naming_the_op_and_class(tmp_path):
    gm = _graph(lambda g, x: g.call_function(torch.ops.aten.as_strided.default, (x, [1], [1])))
    with pytest.raises(
        gg.SaveError,
        match=r"cannot save the model: node '\w+' calls the ATen operator "
        r"'as_strided.default' \(storage: ",
    ):
        gg.save_model(gm, tmp_path / "m.pt")
    assert not list(tmp_path.iterdir())


# ---- fuzz: random ATen ops from the whole registry ---------------------------------------------------------

OPS = sorted(aten_policy.table())
ARG = st.one_of(
    st.just({"node": "x"}),
    st.integers(-3, 3),
    st.floats(-2, 2, allow_nan=False),
    st.booleans(),
    st.none(),
    st.sampled_from(["", "x", "/tmp/gg-aten-canary", "reflect"]),
    st.lists(st.integers(-2, 4), max_size=3),
)
FORBIDDEN = (
    "os.system",
    "subprocess.Popen",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.remove",
    "os.rename",
    "os.rmdir",
    "shutil.",
    "ctypes.",
    "socket.",
    "os.kill",
)
DRAWN_MODULES = (
    "x",
    "os",
    "reflect",
    "/tmp/gg-aten-canary",
)  # an import named by the file (torch's own lazy ones are fine)
_SEEN: list[str] = []
_ARMED = [False]


def _audit(event: str, args) -> None:
    if _ARMED[0] and (
        event.startswith(FORBIDDEN)
        or (event == "import" and args and args[0] in DRAWN_MODULES)
        or (
            event == "open"
            and (
                len(args) > 1
                and isinstance(args[1], str)
                and any(c in args[1] for c in "wax+")
                or "gg-aten-canary" in str(args[0])
            )
        )
    ):
        _SEEN.append(event)


sys.addaudithook(_audit)  # hooks cannot be removed; it records only while armed


def _node(name, op, target, *args) -> dict:
    return {
        "name": name,
        "op": op,
        "target": target,
        "args": {"tuple": list(args)},
        "kwargs": {"dict": []},
        "scope": [],
    }


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 100,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(st.tuples(st.sampled_from(OPS), st.lists(ARG, max_size=3)), min_size=1, max_size=3))
def test_random_aten_graphs_are_refused_with_a_class_or_run_nothing_else(tmp_path, ops):
    nodes = [_node("x", "placeholder", "x")]
    for i, (target, args) in enumerate(ops):
        nodes.append(_node(f"n{i}", "call_function", target, *args))
    nodes.append(_node("output", "output", "output", {"node": "x"}))
    payload = {
        "format": serialize.FORMAT,
        "version": serialize.VERSION,
        "class_name": "GraphModule",
        "root": small_cnn(),
        "nodes": nodes,
        "meta": {"input_shape": [1, 3, 8, 8], "log": []},
    }
    f = tmp_path / "fuzz.pt"
    torch.save(payload, f)
    _SEEN.clear()
    _ARMED[0] = True
    try:
        loaded = load_model(f)
        for n in loaded.module.graph.nodes:  # what got through is allowed by the principle, always
            if n.op == "call_function":
                assert aten_policy.refusal(serialize.qualified_name(n.target)) is None
        with contextlib.suppress(gg.GraphgrowError):
            gg.annotate(loaded.module, (1, 3, 8, 8))
    except gg.LoadError as e:
        bad = [t for t, _ in ops if aten_policy.refusal(t) is not None]
        assert (
            "elements" in e.message
            or "do not fit" in e.message
            or any(f"'{t.removeprefix(P)}' ({aten_policy.table()[t]}: " in e.message for t in bad)
        ), e.message
    finally:
        _ARMED[0] = False
    assert not _SEEN, _SEEN
