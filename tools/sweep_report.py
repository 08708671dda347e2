"""A sweep's results as a markdown table (tools/sweep.py): a run's exit classified as verified / refused / broken,
a refusal's one-line reason sorted into a small set of classes by what it says, and the generated docs/sweep.md
(per registry: counts, a model × pass grid, the refusals with their reasons, the broken runs with their messages).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict


# exit codes (docs/safety.md): 0 ok, 1 a check failed, 2 refused (bad input or a pass that cannot apply),
# 3 internal error
def status_of(rc: int | None, timed_out: bool) -> str:
    if timed_out:
        return "broken"
    return {0: "verified", 2: "refused"}.get(rc if rc is not None else -1, "broken")


def broken_kind(rc: int | None, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    return {1: "check failed (exit 1)", 3: "internal error (exit 3)"}.get(
        rc if rc is not None else -1, f"crash (exit {rc})"
    )


# (class, pattern) in order: the first that matches a refusal's message names its class
REASON_CLASSES: list[tuple[str, re.Pattern]] = [
    (c, re.compile(p, re.I))
    for c, p in [
        ("cannot save", r"cannot save|cannot be saved|allow-?list|not allowed in a (saved|stored)|stored graph"),
        ("cannot estimate", r"cannot estimate|cannot be (sized|estimated)"),
        (
            "cannot capture",
            r"cannot (trace|capture|export)|torch\.export|symbolic trac|untraceable|data-dependent|"
            r"graphs .* differ in|cannot merge|mode-branch|graph break",
        ),
        ("limit", r"--max-(params|memory|load)|past the limit|more than \S+ (of memory|parameters)|too large"),
        (
            "model does not build",
            r"\(\) failed|config refused|has no field|has no \S+ model for|no model type|"
            r"cannot build|example input|needs --input|give the input|does not take|input .* (refused|needs)",
        ),
        (
            "no place",
            r"has none|no place|no branch merge|nothing to|found no|the model has no|no layer in this model|"
            r"has no (conv|attention|residual|stream|hidden|head|layer|norm|linear|token stream)|"
            r"no (residual stream|attention|layer|conv|candidate|target)|no heads to add|"
            r"is dead for it .*also once the model's zero weights have moved",
        ),
        (
            "impossible by construction",
            r"impossib|by construction|cannot grow|would not be exact|not exact|fixed by|"
            r"tied|reads? the (grown|raw)|fixes the size|cannot change|cannot connect",
        ),
        (
            "not understood",
            r"not understood|does not understand|unsupported|not supported|unknown|cannot follow|"
            r"not recogni[sz]ed|cannot (tell|find|analy[sz]e|see)",
        ),
    ]
]


# a refusal inside a captured part (jobs/part_growth.py): the whole model could not be captured, so what the part
# lacks ("no attention", "fixed by the caller") says nothing about the model; never a stated impossibility
IN_A_PART = re.compile(r"^in the part '")


# the CLI's note when a pass grew inside a captured part (capture/parts.Part.summary)
GROWN_IN_PART = re.compile(r"^note: growing inside the part '([^']*)'", re.M)


def part_of(stdout: str) -> str:
    """The part a verified run grew inside ('' where it grew the whole model)."""
    found = GROWN_IN_PART.search(stdout)
    return found.group(1) if found else ""


def reason_class(message: str) -> str:
    if IN_A_PART.search(message):
        return "cannot capture"
    return next((c for c, p in REASON_CLASSES if p.search(message)), "other")


def _cell(r: dict) -> str:
    if r["status"] == "verified":
        return "✓ part" if r.get("part") else "✓"
    if r["status"] == "refused":
        return f"R: {r['class']}"
    return f"**✗ {r['class']}**"


def _md(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def render(results: list[dict], header: str, passes: tuple[str, ...], extra: dict[str, list[str]] | None = None) -> str:
    """The whole docs/sweep.md: the header, then per registry its counts, `extra[registry]` (the targets, from
    tools/sweep_targets.py), grid, refusals and broken runs."""
    lines = [header.rstrip(), ""]
    by_registry: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_registry[r["registry"]].append(r)
    for registry in sorted(by_registry):
        runs = by_registry[registry]
        status = Counter(r["status"] for r in runs)
        models = list(dict.fromkeys(r["model"] for r in runs))
        lines += [
            f"## {registry}",
            "",
            f"{len(runs)} runs over {len(models)} models: "
            f"**{status['verified']} verified, {status['refused']} refused, "
            f"{status['broken']} broken**.",
            "",
        ]
        lines += ["| pass | verified | refused | broken |", "|---|---|---|---|"]
        for p in passes:
            c = Counter(r["status"] for r in runs if r["pass"] == p)
            if c:
                lines.append(f"| {p} | {c['verified']} | {c['refused']} | {c['broken']} |")
        lines += ["", "| class | runs |", "|---|---|"]
        for cls, n in Counter((r["status"], r["class"]) for r in runs if r["status"] != "verified").most_common():
            lines.append(f"| {cls[0]}: {cls[1]} | {n} |")
        in_part = [r for r in runs if r["status"] == "verified" and r.get("part")]
        if in_part:
            lines += [
                "",
                f"{len(in_part)} of the verified runs (✓ part) grew inside a part of a model that cannot be captured "
                "whole (docs/tracing.md), the whole model compared with the original in eval mode: "
                + ", ".join(sorted({f"{r['model']} ('{r['part']}')" for r in in_part}))
                + ".",
            ]
        lines += ["", *(extra or {}).get(registry, [])]
        used = [p for p in passes if any(r["pass"] == p for r in runs)]
        cells = {(r["model"], r["pass"]): r for r in runs}
        lines += ["", "| model | " + " | ".join(used) + " |", "|---|" + "---|" * len(used)]
        for m in models:
            lines.append(f"| {m} | " + " | ".join(_cell(cells[(m, p)]) if (m, p) in cells else "" for p in used) + " |")
        broken = [r for r in runs if r["status"] == "broken"]
        if broken:
            lines += ["", "### Broken", "", "| model | pass | kind | message |", "|---|---|---|---|"]
            lines += [f"| {r['model']} | {r['pass']} | {r['class']} | {_md(r['message'])} |" for r in broken]
        refused = [r for r in runs if r["status"] == "refused"]
        if refused:
            lines += ["", "### Refusals", "", "| model | pass | class | reason |", "|---|---|---|---|"]
            lines += [
                f"| {r['model']} | {r['pass']} | {r['class']} | {_md(r['message'])} |"
                for r in sorted(refused, key=lambda r: (r["class"], r["model"], r["pass"]))
            ]
        lines.append("")
    return "\n".join(lines)
