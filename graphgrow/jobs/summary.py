"""A torchinfo-like summary of a traced model: one row per module at a depth (what `graphgrow inspect` prints)."""

from __future__ import annotations

from torch import fx


def module_summary(gm: fx.GraphModule, depth: int = 1) -> list[dict]:
    """One row per module at `depth` levels below the model (torchinfo-like): its output shape (the
    last node inside it), parameters, FLOPs and node count, in graph order; top-level ops get their own row."""
    from ..graph.graph_meta import scope_of

    rows: dict[str, dict] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        path = str(n.target) if n.op == "call_module" else (scope_of(n)[-1] if scope_of(n) else "")
        key = ".".join(path.split(".")[:depth]) if path else n.name
        kind = type(gm.get_submodule(key)).__name__ if path and key in dict(gm.named_modules()) else n.op
        row = rows.setdefault(key, {"module": key, "type": kind, "shape": None, "params": 0, "flops": 0, "nodes": 0})
        row["shape"] = n.meta.get("gg_shape") or row["shape"]
        row["params"] += n.meta.get("gg_params", 0) or 0
        row["flops"] += n.meta.get("gg_flops", 0) or 0
        row["nodes"] += 1
    return list(rows.values())
