"""Reports as text: the tables and lines each command prints (--json prints the report itself), and the
pass-argument table docs/passes.md shows."""

from __future__ import annotations

import dataclasses

from rich.markup import escape
from rich.table import Table

from ..core.errors import GraphgrowError
from .run import out


def input_text(report: dict) -> str:
    """`input 1×3×224×224`, or `inputs input_ids:int64[1,16], …` for named inputs."""
    if report.get("inputs"):
        return "inputs " + ", ".join(f"{r['name']}:{r['dtype']}{list(r['shape'])}" for r in report["inputs"])
    return f"input {'×'.join(map(str, report['input_shape']))}"


def print_mutation(report: dict) -> None:
    verb = f"replay of {report['log_from']} on" if "log_from" in report else "mutate"
    out.print(f"[bold]graphgrow {verb}[/] {report['model']} ({input_text(report)})")
    if report.get("input_shape_inferred"):
        out.print(f"input shape inferred: {report['input_shape_inferred']}")
    if report.get("part_note"):  # grown inside a part: which one and why (capture/parts.py)
        out.print(f"note: {report['part_note']}", markup=False, highlight=False)
    for i, p in enumerate(report["passes"], 1):
        args = ", ".join(f"{k}={v}" for k, v in p["args"].items() if v is not None)
        out.print(f"[bold]{i}. {p['name']}[/]({args})")
        for k, v in p["targets"].items():
            if isinstance(v, list):
                out.print(f"   {k}:", markup=False, highlight=False)
                for item in v:
                    out.print(f"     - {item}", markup=False, highlight=False)
            else:
                out.print(f"   {k}: {v}")
        out.print(f"   nodes: +{len(p['nodes_added'])} −{len(p['nodes_removed'])}")
        out.print(f"   params: {p['params_before']:,} → {p['params_after']:,}")
        out.print(f"   FLOPs/example: {p['flops_before']:,} → {p['flops_after']:,}")
        pres = p.get("preservation")
        if pres and pres["train_rel_err"] is None:
            out.print(f"   verified in eval mode: rel err {pres['eval_rel_err']:.1e}")
        elif pres:
            steps = ", ".join(f"{k}@{v}" for k, v in pres["new_parameters"].items())
            out.print(
                f"   verified: eval rel err {pres['eval_rel_err']:.1e}, train rel err {pres['train_rel_err']:.1e}; "
                f"new parameters learn (first gradient at SGD step): {steps or 'none new'}"
            )
            if pres.get("unreached_parameters"):
                out.print(
                    "   no gradient reaches, as none reaches the old layers they join (in the original model too): "
                    + ", ".join(pres["unreached_parameters"]),
                    markup=False,
                    highlight=False,
                )
        for note in p.get("notes", []):
            out.print(f"   note: {note}")
    whole = report.get("whole_check")
    if whole:
        out.print(
            f"whole model before and after ({whole['mode']} mode, {whole['input']}): the part's output rel err "
            f"{whole['part']['rel_err']:.1e} ({whole['part']['values']:,} values), the model's outputs rel err "
            f"{whole['whole']['rel_err']:.1e} ({whole['whole']['values']:,} values)"
        )
    if report.get("onnx_note"):
        out.print(f"note: {report['onnx_note']}", markup=False, highlight=False)
    eq = report.get("equivalence")
    if eq is not None:
        print_equivalence(eq)
        print_equivalence(eq["vs_original"])
    for path in report["outputs"]:
        out.print(f"wrote {path}")
    if report.get("dry_run"):
        out.print(
            f"dry run: no model written (would write {', '.join(report['dry_run']['would_write'])})",
            markup=False,
            highlight=False,
        )
    if report.get("output_note") and report["outputs"]:
        out.print(f"note: {report['output_note']}", markup=False, highlight=False)
    if report.get("trust_note"):
        out.print(f"note: {report['trust_note']}", markup=False, highlight=False)
    timing = ", ".join(f"{k} {v:.1f}s" for k, v in report.get("timings", {}).items())
    if timing:
        out.print(f"time: {timing}")


def print_equivalence(eq: dict) -> None:
    from ..verify.equivalence import EquivalenceReport, OutputStats

    rep = EquivalenceReport(
        eq["provider"],
        eq["note"],
        eq["rtol"],
        eq["atol"],
        [OutputStats(**c) for c in eq["cases"]],
        eq.get("reference", "model"),
    )
    out.print(rep.table())
    out.print(f"provider: {eq['note']}")
    verdict = "[green]PASS[/]" if rep.passed else "[red]FAIL[/]"
    out.print(
        f"equivalence vs {rep.reference}: {verdict} (max abs {rep.max_abs_err:.2e}, max rel {rep.max_rel_err:.2e})"
    )


def print_summary(model: str, report: dict) -> None:
    t = Table(title=f"{model} ({input_text(report)}): one row per module")
    for col in ("module", "type", "output shape", "params", "FLOPs", "nodes"):
        t.add_column(col, justify="right" if col in ("params", "FLOPs", "nodes") else "left")
    for r in report["summary"]:
        shape = "×".join(map(str, r["shape"])) if isinstance(r["shape"], (tuple, list)) else str(r["shape"] or "")
        t.add_row(
            escape(r["module"]),
            r["type"],
            shape,
            f"{r['params']:,}" if r["params"] else "",
            f"{r['flops']:,}" if r["flops"] else "",
            str(r["nodes"]),
        )
    out.print(t)
    out.print(
        f"total: {report['params']:,} parameters, {report['flops']:,} FLOPs per example, {len(report['nodes'])} nodes"
    )
    print_log(report["log"])


def print_onnx(report: dict) -> None:
    out.print(
        f"[bold]{escape(report['model'])}[/]: ONNX IR {report['ir_version']}, opset "
        f"{report['opset'][0] if report['opset'] else '?'}, {report['producer'] or 'unknown producer'}"
    )
    for kind in ("inputs", "outputs"):
        for v in report[kind]:
            out.print(
                f"{kind[:-1]} {v['name']}: {v['dtype']} [{', '.join(map(str, v['shape']))}]",
                markup=False,
                highlight=False,
            )
    ops = ", ".join(f"{op} {n}" for op, n in report["ops"].items())
    out.print(f"{report['nodes']:,} nodes ({ops}); {report['params']:,} parameters", markup=False, highlight=False)
    if report.get("external_data"):
        ext = report["external_data"]
        out.print(f"weights in {', '.join(ext['files'])} ({ext['bytes']:,} bytes)", markup=False, highlight=False)
    for k, v in report["metadata"].items():
        out.print(f"metadata {k}: {v}", markup=False, highlight=False)
    print_log(report["log"])


def print_log(log: list) -> None:
    for i, e in enumerate(log, 1):
        out.print(
            f"mutation {i}: {e['pass']}({', '.join(f'{k}={v}' for k, v in e['args'].items() if v is not None)}) "
            f"params {e['params_before']:,} → {e['params_after']:,}",
            markup=False,
            highlight=False,
        )


def print_trace(trace: dict, show_all: bool = False) -> None:
    """How the model was traced: automatic leaves and why (the same reason once, with its modules,
    unless --all), notes, the fidelity checks that passed."""
    if not trace:
        return
    leaves = trace.get("auto_leaves") or {}
    if leaves:
        out.print(f"automatic leaves ({len(leaves)}):", markup=False)
        by_reason: dict[str, list[str]] = {}
        for path, why in leaves.items():
            by_reason.setdefault(why, []).append(path)
        for why, paths in by_reason.items():
            if show_all or len(paths) <= 3:
                for path in paths:
                    out.print(f"  {path}: {why}", markup=False)
            else:
                shown = ", ".join(paths[:3])
                out.print(f"  {len(paths)} × {why}: {shown}, … (--all lists every one)", markup=False)
    for note in trace.get("notes", []):
        out.print(f"trace: {note}", markup=False)
    if trace.get("fidelity"):
        out.print(f"trace matches the model: {', '.join(trace['fidelity'])} (mode@batch)", markup=False)


def print_groups(report: dict) -> None:
    t = Table(title=f"channel groups of {report['model']}: tensors whose channel count must change together")
    for col in ("group", "channels", "tensors", "sources (grow out)", "consumers (grow in)", "status"):
        t.add_column(col, justify="right" if col in ("group", "channels", "tensors") else "left")
    for g in report["groups"]:
        blocked = g["blocked_by"]
        status = (
            "[green]growable[/]"
            if not blocked
            else "[red]frozen:[/] "
            + escape("; ".join(blocked[:2]))
            + (f" (+{len(blocked) - 2} more)" if len(blocked) > 2 else "")
        )
        if not blocked and g.get("norms_reached"):
            status += " (LayerNorm: init=net2net, integer factor)"
        t.add_row(
            str(g["id"]),
            str(g["channels"]),
            str(len(g["members"])),
            ", ".join(g["sources"]) or "-",
            ", ".join(g["consumers"]) or "-",
            status,
        )
    out.print(t)


def print_search(report: dict) -> None:
    t = Table(title=f"population after the search ({report['seconds']:.0f} s)")
    for col in ("trial", report["metric"], "parameters", "growths", "lr"):
        t.add_column(col, justify="left" if col == "trial" else "right")
    for row in sorted(report["trials"], key=lambda r: r["trial"]):
        value = row.get(report["metric"])
        t.add_row(
            escape(row["trial"]) + (" *" if row["trial"] == report["trial"] else ""),
            "-" if value is None else f"{value:.4g}",
            f"{row.get('params') or 0:,.0f}",
            str(row.get("growths")),
            "-" if row.get("lr") is None else f"{row['lr']:.3g}",
        )
    out.print(t)
    out.print(
        f"best: {report['best']} ({report['metric']} {report['value']:.4g}, trial {report['trial']})", markup=False
    )
    if report["lineage"]:
        out.print("lineage (from the original):", markup=False)
        for i, e in enumerate(report["lineage"], 1):
            args = ",".join(f"{k}={v}" for k, v in e.get("args", {}).items() if v is not None)
            out.print(
                f"  {i}. {e['pass']}({args}) seed {e['seed']}: "
                f"{e['params_before']:,} → {e['params_after']:,} parameters",
                markup=False,
            )
        from ..jobs.pipeline import logged_code

        names = sorted(
            {name for _, _, name in logged_code(report["lineage"])}
        )  # named again: a file's names are not imported
        data = f" --data {names[0]}" if len(names) == 1 else " --data PKG.MOD:FN" if names else ""
        out.print(f"replay it: graphgrow replay {report['original']} {report['best']}{data}", markup=False)
    else:
        out.print("lineage: the best trial did not grow (the original architecture won)", markup=False)
    out.print(f"deploy it: graphgrow export {report['best']} -o best.onnx", markup=False)
    if report.get("plot"):
        out.print(f"plot: {report['plot']}", markup=False)


def passes_markdown(found: dict) -> str:
    """The argument table of docs/passes.md: one row per argument of every installed pass."""
    rows = ["| pass | argument | type | default | meaning |", "|---|---|---|---|---|"]
    for name, cls in found.items():
        if isinstance(cls, GraphgrowError):
            continue
        helps = cls.argument_help()
        fields = dataclasses.fields(cls)
        if not fields:
            rows.append(f"| `{name}` | none | | | |")
        for f in fields:
            cells = [f"`{name}`", f"`{f.name}`", argument_type(cls, f.name), f"`{f.default!r}`", helps[f.name]]
            rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    contracts = [
        "| pass | requires (checked before it runs) | ensures (checked after it changed the graph) |",
        "|---|---|---|",
    ]
    for name, cls in found.items():
        if not isinstance(cls, GraphgrowError) and (cls.requires or cls.ensures):
            contracts.append(
                f"| `{name}` | {'; '.join(r.name for r in cls.requires)} | {'; '.join(g.name for g in cls.ensures)} |"
            )
    return "\n".join(rows) + "\n\n" + "\n".join(contracts)


def argument_type(cls, name: str) -> str:
    """An argument's type as `graphgrow passes` and docs/passes.md show it: the annotation with the values its
    declaration allows (`float, in (0, 16]`, `int | None, ≥ 1`; choices as `one of a|b`)."""
    from ..rewrite.arguments import admits_none

    hint, allowed = cls.argument_types()[name], cls.argument_allowed()[name]
    if allowed.choices is not None:
        return allowed.describe() + (" | None" if admits_none(hint) else "")
    said = allowed.describe()
    return type_name(hint) + (f", {said}" if said else "")


def contract(cls) -> str:
    """What a pass requires and ensures, in words ("" when it declares neither)."""
    parts = [f"requires {', '.join(r.name for r in cls.requires)}"] if cls.requires else []
    parts += [f"ensures it {', '.join(g.name for g in cls.ensures)}"] if cls.ensures else []
    return "; ".join(parts)


def type_name(t) -> str:
    """int, float | None, one of conv3x3|conv5x5|... (a Literal's choices spelled out)."""
    import types
    import typing

    origin = typing.get_origin(t)
    if origin is typing.Literal:
        return "one of " + "|".join(map(str, typing.get_args(t)))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(t))
    if t is type(None):
        return "None"
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")
