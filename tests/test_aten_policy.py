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


# ---- round trips: allowed ops drawn from the whole registry save, load and compute the same ---------------


def _filled(op: torch._ops.OpOverload, x: fx.Node):
    """Arguments for `op` from its schema: every tensor is the input x, every other required argument a small
    value of its type (a dim 0, a scalar 2, a list [1]); None where an argument type has no such value."""
    args = []
    for a in op._schema.arguments:
        if a.kwarg_only:
            if not a.has_default_value():
                return None
            continue
        t = str(a.type)
        if a.has_default_value() and "Tensor" not in t:
            break  # the rest by default
        value = {
            "Tensor": x,
            "Tensor[]": [x, x],
            "int": 0,
            "SymInt": 2,
            "float": 0.5,
            "bool": False,
            "Scalar": 2,
            "int[]": [1],
            "SymInt[]": [4, 4],
            "int[1]": [0],
            "Optional[Tensor]": x,
            "ScalarType": torch.float64,
        }.get(t, _NO)
        if value is _NO:
            return None
        args.append(value)
    return tuple(args)


_NO = object()


def _runnable_ops(x: torch.Tensor) -> list[tuple[torch._ops.OpOverload, tuple]]:
    """Every allowed, functional ATen overload whose filled arguments run on x in eager mode."""
    out = []
    g = fx.Graph()
    node = g.placeholder("x")
    for name, op in sorted(aten_policy._by_name().items()):
        if aten_policy.table()[P + name] is not None or op._schema.is_mutable or aten_policy.is_factory(P + name):
            continue
        args = _filled(op, node)
        if args is None:
            continue
        try:
            with torch.random.fork_rng():
                op(*[x if a is node else [x, x] if a == [node, node] else a for a in args])
        except Exception:
            continue
        out.append((op, args))
    return out


def test_allowed_ops_drawn_from_the_registry_save_load_and_compute_the_same(tmp_path):
    """The principle's promise, fuzzed: a graph of allowed ATen ops drawn from every overload torch registers (those
    whose schema-filled arguments run on a 4×4 input) is saved, read back without --trust and gives outputs equal to
    the original's, bit for bit (random ops under the same seed)."""
    import random

    x = torch.randn(4, 4, dtype=torch.float64)
    ops = _runnable_ops(x)
    assert len(ops) > 300  # the allowed set is broad: hundreds of overloads run on a plain tensor
    drawn = random.Random(int(os.environ.get("GRAPHGROW_FUZZ_SEED", "39"))).sample(ops, min(len(ops), 3 * EXAMPLES))

    def build(g, node):
        return tuple(g.call_function(op, _rebind(args, node)) for op, args in drawn)

    gm = _graph(build)
    gm.meta["graphgrow"]["input_shape"] = [4, 4]
    gg.save_model(gm, tmp_path / "m.pt")
    loaded = load_model(tmp_path / "m.pt").module  # no --trust
    with torch.random.fork_rng():
        torch.manual_seed(0)
        want = gm(x)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        got = loaded(x)
    for (op, _), a, b in zip(drawn, got, want):
        if op._schema.name.removeprefix("aten::").startswith(("empty", "new_empty")):
            continue  # uninitialised memory: nothing to compare
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m, op=op: f"{op}: {m}")


def _rebind(args: tuple, node: fx.Node) -> tuple:
    """The filled arguments with the builder's input node in place of the probe's."""
    return tuple(
        node
        if isinstance(a, fx.Node)
        else [node, node]
        if isinstance(a, list) and a and isinstance(a[0], fx.Node)
        else a
        for a in args
    )


class _Methods(nn.Module):
    """The methods fx traces from Hugging Face and timm code that the hand-picked list lacked (issue 39)."""

    def forward(self, x):
        mask = torch.ones_like(x).triu(1).bool()
        scores = x.masked_fill(mask, -1e4).tril(0).softmax(-1)
        top, idx = scores.topk(2, dim=-1)
        rows = x.repeat_interleave(2, dim=0).unbind(0)
        return top.type_as(x), idx, rows[3], torch._C._nn.softplus(x), x.logsumexp(-1), x.clamp_min(0.1).reciprocal()


def test_tensor_methods_are_derived_from_aten_and_round_trip(tmp_path):
    gm = fx.symbolic_trace(_Methods())
    methods = {n.target for n in gm.graph.nodes if n.op == "call_method"}
    assert {"triu", "tril", "topk", "type_as", "repeat_interleave", "unbind", "logsumexp"} <= methods
    assert not methods & graph_policy.ALLOWED_METHODS - {"bool"}  # derived, not listed
    gm.meta["graphgrow"] = {"input_shape": [4, 4], "log": []}
    gg.save_model(gm, tmp_path / "m.pt")
    loaded = load_model(tmp_path / "m.pt").module  # no --trust
    x = torch.randn(4, 4)
    for a, b in zip(loaded(x), gm(x)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "method, why",
    [
        ("set_", "storage: "),
        ("resize_", "storage: "),
        ("to_sparse", "sparse: "),
        ("requires_grad_", "mutating: "),
        ("apply_", "no ATen operator's method"),  # takes a callable
        ("map_", "no ATen operator's method"),
        ("storage", "no ATen operator's method"),
        ("data_ptr", "no ATen operator's method"),
        ("share_memory_", "no ATen operator's method"),
        ("register_hook", "no ATen operator's method"),
        ("stft", "overrides it in Python"),
        ("__reduce_ex__", ""),
    ],
)
def test_an_excluded_method_is_refused_with_its_reason(method, why):
    assert not graph_policy.allowed_method(method)
    with pytest.raises(gg.LoadError, match=f"'{method}'.*{why}"):
        graph_policy.check_method(method, "n")


def test_bindings_in_torchs_nn_special_linalg_fft_namespaces_are_derived():
    for qualname in (
        "torch._C._nn.softplus",
        "torch._C._special.special_erf",
        "torch._C._linalg.linalg_vector_norm",
        "torch._C._nn.log_sigmoid",
    ):
        graph_policy.check_function(qualname, "n")
    for qualname in ("torch._C._nn._parse_to", "torch._C._nn.mkldnn_linear", "torch._C._VariableFunctions.save"):
        with pytest.raises(gg.LoadError):
            graph_policy.check_function(qualname, "n")
