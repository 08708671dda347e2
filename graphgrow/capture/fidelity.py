"""Is the traced graph the user's model? Compared in eval and train mode before any pass runs.

Preservation is only meaningful when the graph a pass grows computes what the user's
module computes. A mismatch here is a trace problem and is reported as one, naming
the first submodule whose output differs (found with forward hooks on the module and
an interpreter over the graph), never left for a pass's preservation check to find.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_structure

from ..core.errors import InputError, TraceError, first_line
from ..core.protocol import BATCHES, TRAIN_PROTOCOL, flat_tensors, measure
from ..core.state import dropout_off, preserved_buffers, seeded, training_mode
from ..core.threads import check_threads
from ..graph.float32_run import Float32Graph, is_half, widened
from ..graph.graph_meta import graph_info, scope_of
from ..graph.inputs import ExampleInput, InputSpec, as_spec, call, positional, shown
from ..graph.reference import remember
from ..graph.shapes import example_input


def _run(m: nn.Module, x: Any, mode: str, seed: int) -> Any:
    with torch.no_grad(), training_mode(m, mode == "train"), preserved_buffers(m), seeded(seed):
        return call(m, x)


def _difference(ref: Any, got: Any, mode: str = "eval") -> str | None:
    """None when `got` matches `ref` (structure, shapes, dtypes, values within the check protocol's tolerance);
    else what differs. Each output tensor is measured on its own (core.protocol.measure), to name the first that
    differs; dtypes, integer outputs and NaN where the model gives NaN are checked here too (a trace must keep
    them, which preservation's comparison of a graph with its own growth need not ask)."""
    a, b = flat_tensors(ref), flat_tensors(got)
    if len(a) != len(b):
        return f"{len(a)} output tensors in the model, {len(b)} in the graph"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            return f"output {i} has shape {tuple(x.shape)} in the model, {tuple(y.shape)} in the graph"
        if x.dtype != y.dtype:
            return f"output {i} is {x.dtype} in the model, {y.dtype} in the graph"
        if not x.is_floating_point():
            if not torch.equal(x, y):
                return f"output {i} differs"
            continue
        xd, yd = x.detach().double(), y.detach().double()
        both_nan = torch.isnan(xd) & torch.isnan(yd)
        xd, yd = torch.where(both_nan, 0.0, xd), torch.where(both_nan, 0.0, yd)
        if not torch.isfinite(yd - xd).all() and not torch.equal(xd, yd):
            return f"output {i} has NaN/Inf in one and not the other"
        check = measure(xd, yd, mode)
        if not check.fp32_ok:
            return (
                f"output {i} differs: relative error {check.rel_err:.3g}, max |Δ| {check.max_abs_err:.3g} "
                f"(max |out| {check.max_abs_ref:.3g})"
            )
    return None


def check_fidelity(model: nn.Module, gm: fx.GraphModule, input_shape: ExampleInput, seed: int = 0) -> dict:
    """Compare `gm` with `model` in eval and train mode at two batch sizes; raise TraceError on a mismatch.

    Same inputs, same RNG state (dropout draws alike on both sides), buffers restored
    afterwards; neither module is changed. A top-level forward that branches on
    `self.training` was traced in one mode: in the other mode a different output
    *structure* (auxiliary heads) is expected and noted; different values are not.
    Returns the fidelity report, also stored in the trace report. A small model is checked with one
    intra-op thread (core.threads).
    """
    spec = as_spec(input_shape, model)
    with check_threads(model, spec):
        if not is_half(gm):
            return _check(model, gm, spec, seed)
        # a bfloat16/float16 model: compared in float32 on its stored values (the model widened in place for the
        # check, the graph run node by node, graph.float32_run), since a stand-in layer (capture.standins) may
        # round where the model's own does not (F.rms_norm once, LlamaRMSNorm before its scale too)
        with widened(model):
            return _check(model, Float32Graph(gm), spec, seed)


def _check(model: nn.Module, gm: fx.GraphModule | Float32Graph, input_shape: InputSpec, seed: int) -> dict:
    report = graph_info(gm).setdefault("trace", {})
    traced_mode = report.get("mode", "eval")
    top_dependent = bool(report.get("top_level_mode_dependent"))
    name = type(model).__name__
    checked: list[str] = []
    kept: dict[str, tuple[Any, Any]] = {}
    for mode in ("eval", "train"):
        for batch, s in zip(BATCHES, (seed, seed + 22)):  # eval at batch 2, seed 0 is verification's reference input
            x = example_input(model, input_shape, seed=s, batch=batch)
            try:
                ref = _run(model, x, mode, seed)
            except Exception as e:
                raise InputError(
                    f"{name} cannot run on an input of shape {shown(input_shape)} (at batch {batch}, {mode} mode): "
                    f"{first_line(e)}",
                    "give the shape the model expects with --input-shape N,C,H,W",
                ) from e
            try:
                got = _run(gm, x, mode, seed)
            except Exception as e:
                raise TraceError(
                    f"the traced graph of {name} fails in {mode} mode at batch {batch} where the model runs: "
                    f"{first_line(e)}",
                    "mark the submodule involved as a leaf with --leaf MODULE",
                ) from e
            diff = _difference(ref, got, mode)
            if diff is None:
                checked.append(f"{mode}@{batch}")
                if batch == BATCHES[0]:
                    kept[mode] = (x, got)
                continue
            if top_dependent and mode != traced_mode:
                if tree_structure(ref) != tree_structure(got) or len(flat_tensors(ref)) != len(flat_tensors(got)):
                    report.setdefault("notes", []).append(
                        f"in {mode} mode {name} returns {len(flat_tensors(ref))} output tensors; the graph keeps the "
                        f"{traced_mode}-mode outputs ({len(flat_tensors(got))})"
                    )
                    break
                raise TraceError(
                    f"the top-level forward of {name} branches on self.training and computes differently in {mode} "
                    f"mode than the {traced_mode}-mode code that was traced ({diff})",
                    "move the mode-dependent code into a submodule (graphgrow keeps such submodules as leaves), "
                    f"or trace the {mode}-mode code with --trace-mode {mode}",
                )
            where = locate_divergence(model, gm.gm if isinstance(gm, Float32Graph) else gm, x, mode, seed)
            raise TraceError(
                f"the traced graph is not {name} in {mode} mode at batch {batch}: {where or diff}",
                "mark that submodule as a leaf with --leaf MODULE, or remove the Python-level state "
                "its forward depends on",
            )
    report["fidelity"] = checked
    if isinstance(gm, Float32Graph):  # float32 outputs are no reference for a half-precision graph's own runs
        return report
    # the first pass's verification compares against these outputs; the graph is as it was then
    if "eval" in kept:
        remember(gm, "eval", *kept["eval"])
    if "train" in kept and not _drops(gm):  # verification's train protocol turns dropout off: the same run here
        remember(gm, f"{TRAIN_PROTOCOL} {seed}", *kept["train"])
    return report


def _drops(gm: nn.Module) -> bool:
    """Whether verification's dropout_off changes anything in `gm` (a dropout layer with p > 0, or a flag read as a
    dropout probability): then train mode here differs from verification's."""
    with training_mode(gm, True), dropout_off(gm):
        return any(
            not m.training and not (isinstance(m, nn.modules.dropout._DropoutNd) and m.p == 0) for m in gm.modules()
        )


def locate_divergence(model: nn.Module, gm: fx.GraphModule, x: Any, mode: str, seed: int) -> str | None:
    """The first submodule (in call order, innermost first) whose output differs between module and graph."""
    calls: list[tuple[str, Any]] = []
    names = {id(m): p for p, m in model.named_modules() if p}
    hooks = []

    def record(path: str):
        return lambda mod, args, out: calls.append((path, _detach(out)))

    for m in model.modules():
        if id(m) in names:
            hooks.append(m.register_forward_hook(record(names[id(m)])))
    try:
        _run(model, x, mode, seed)
    except Exception:
        return None
    finally:
        for h in hooks:
            h.remove()
    values: dict[str, Any] = {}

    class Capture(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            values[n.name] = _detach(out)
            return out

    try:
        with torch.no_grad(), training_mode(gm, mode == "train"), preserved_buffers(gm), seeded(seed):
            Capture(gm).run(*positional(x))
    except Exception as e:
        return f"the graph fails ({type(e).__name__}: {first_line(e, 200)})"
    node_of = _module_output_nodes(gm)
    reads = set(graph_info(gm).get("trace", {}).get("mode_reads", []))
    seen = set()
    for path, out in calls:
        if path in seen or path not in node_of:
            continue
        seen.add(path)
        got = values.get(node_of[path])
        if got is None:
            continue
        diff = _difference(out, got, mode)
        if diff is not None:
            cls = type(model.get_submodule(path)).__name__
            why = " (it reads self.training)" if path in reads else ""
            return f"first at submodule '{path}' ({cls}){why}: {diff}"
    return None


def _detach(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    if isinstance(out, (tuple, list)):
        return (
            type(out)(_detach(o) for o in out) if not hasattr(out, "_fields") else type(out)(*(_detach(o) for o in out))
        )
    return out


def _module_output_nodes(gm: fx.GraphModule) -> dict[str, str]:
    """Module path → name of the node holding its output: its call_module node, or the last node traced inside it."""
    found: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            found[str(n.target)] = n.name
        for path in scope_of(n):
            if path and n.op not in ("get_attr", "placeholder", "output"):
                found[path] = n.name
    return found
