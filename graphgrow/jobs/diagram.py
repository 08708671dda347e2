"""A picture of what a growth changed: the graph after it, one box per node in graph order, added
nodes, rebuilt (resized) layers and changed shapes highlighted, unchanged runs collapsed into one
box, edges that skip ahead drawn as arcs. Rendered with matplotlib (SVG, or PNG by suffix)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch import fx

from ..core.errors import InputError
from ..io.save import atomic_write

COLOURS = {"added": "#2ca02c", "rebuilt": "#ff7f0e", "reshaped": "#1f77b4", "same": "#d9d9d9", "run": "#f0f0f0"}


@dataclass
class Item:
    label: str
    status: str  # added, rebuilt, reshaped, same, run (collapsed unchanged nodes)
    names: list[str] = field(default_factory=list)  # the fx nodes it stands for
    detail: str = ""


def _describe(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return f"{n.target}: {type(gm.get_submodule(str(n.target))).__name__}"
    if n.op == "call_function":
        return f"{n.name}: {getattr(n.target, '__name__', str(n.target))}"
    return f"{n.name}: {n.op}"


def _shape(n: fx.Node) -> str:
    s = n.meta.get("gg_shape")
    return "×".join(map(str, s)) if isinstance(s, tuple) else ""


def _sizes(m) -> tuple:
    """A layer's class and tensor shapes: what a rebuild changes (not flags such as inplace, which the
    copy turns off)."""
    if m is None:
        return ()
    return (type(m).__name__, tuple((k, tuple(v.shape)) for k, v in m.state_dict().items()))


def node_changes(old: fx.GraphModule, new: fx.GraphModule) -> tuple[list[Item], list[str]]:
    """One item per node of `new` with its status against `old`, and the names of `old`'s nodes that are gone."""
    old_nodes = {n.name: n for n in old.graph.nodes}
    old_modules = dict(old.named_modules())
    raw: list[Item] = []
    for n in new.graph.nodes:
        before = old_nodes.get(n.name)
        if before is None:
            status = "added"
        elif n.op == "call_module" and _sizes(old_modules.get(str(n.target))) != _sizes(
            new.get_submodule(str(n.target))
        ):
            status = "rebuilt"
        elif before.meta.get("gg_shape") != n.meta.get("gg_shape"):
            status = "reshaped"
        else:
            status = "same"
        detail = _shape(n) if status != "reshaped" else f"{_shape(before)} → {_shape(n)}"
        raw.append(Item(_describe(new, n), status, [n.name], detail))
    gone = [name for name in old_nodes if name not in {n.name for n in new.graph.nodes}]
    return raw, gone


def collapse(raw: list[Item], keep: int = 0) -> list[Item]:
    """Runs of more than 2·keep+1 unchanged items as one box (`keep` shown at each end)."""
    items: list[Item] = []
    i = 0
    while i < len(raw):
        j = i
        while j < len(raw) and raw[j].status == "same":
            j += 1
        if j - i > 2 * keep + 1:
            items += raw[i : i + keep]
            hidden = raw[i + keep : j - keep]
            first, last = hidden[0].label.split(":")[0], hidden[-1].label.split(":")[0]
            items.append(
                Item(
                    f"… {len(hidden)} unchanged node{'s' if len(hidden) > 1 else ''}",
                    "run",
                    [n for h in hidden for n in h.names],
                    f"{first} … {last}" if len(hidden) > 1 else first,
                )
            )
            items += raw[j - keep : j]
            i = j
        elif j > i:
            items += raw[i:j]
            i = j
        else:
            items.append(raw[i])
            i += 1
    return items


def diagram_format(path: str | Path, fmt: str | None = None) -> str:
    """svg, png or pdf from the file name (checked before any work is done); InputError otherwise."""
    kind = (fmt or Path(path).suffix).lstrip(".").lower() or "svg"
    if kind not in ("svg", "png", "pdf"):
        raise InputError(f"cannot draw to a .{kind} file", "use .svg or .png")
    return kind


def draw(old: fx.GraphModule, new: fx.GraphModule, path: str | Path, title: str = "", fmt: str | None = None) -> Path:
    """Draw `new` against `old` (same lineage) to `path`; the format from `fmt` or the path's suffix
    (.svg, default, or .png)."""
    try:
        import matplotlib
    except ImportError as e:
        raise InputError("drawing needs matplotlib", "pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Patch

    raw, gone = node_changes(old, new)
    items = collapse(raw)
    row = {name: k for k, it in enumerate(items) for name in it.names}
    edges = sorted(
        {(row[a.name], row[n.name]) for n in new.graph.nodes for a in n.all_input_nodes if row[a.name] != row[n.name]}
    )
    height = 0.42 * len(items) + 1.2
    fig, ax = plt.subplots(figsize=(9, height))
    ax.set_xlim(0, 10)
    ax.set_ylim(-len(items) - 0.5, 1)
    ax.axis("off")
    for k, it in enumerate(items):
        y = -k
        box = FancyBboxPatch(
            (0.3, y - 0.32),
            5.4,
            0.64,
            boxstyle="round,pad=0.02,rounding_size=0.12",
            facecolor=COLOURS[it.status],
            edgecolor="black" if it.status != "run" else "#999999",
            linewidth=0.8,
            linestyle="-" if it.status != "run" else "--",
        )
        ax.add_patch(box)
        ax.text(
            0.45,
            y,
            it.label,
            va="center",
            fontsize=8,
            family="monospace",
            color="white" if it.status in ("added", "reshaped") else "black",
        )
        ax.text(5.9, y, it.detail, va="center", fontsize=7.5, color="#444444", family="monospace")
    lanes: list[int] = []
    for a, b in edges:
        if b == a + 1:
            ax.annotate("", xy=(3.0, -b + 0.33), xytext=(3.0, -a - 0.33), arrowprops={"arrowstyle": "-|>", "lw": 0.7})
            continue
        lane = next((i for i, end in enumerate(lanes) if end <= a), len(lanes))  # the first lane free from row a on
        if lane == len(lanes):
            lanes.append(b)
        else:
            lanes[lane] = b
        x = 0.3 - 0.12 * (lane + 1)
        ax.plot([0.3, x, x, 0.3], [-a, -a, -b, -b], color="#555555", linewidth=0.7)
        ax.annotate("", xy=(0.3, -b), xytext=(x, -b), arrowprops={"arrowstyle": "-|>", "lw": 0.7, "color": "#555555"})
    ax.set_xlim(min(-0.2 - 0.12 * len(lanes), 0), 10)
    legend = [
        Patch(facecolor=COLOURS[k], edgecolor="black", label=label)
        for k, label in (
            ("added", "added"),
            ("rebuilt", "rebuilt (resized)"),
            ("reshaped", "shape changed"),
            ("same", "unchanged"),
            ("run", "unchanged, collapsed"),
        )
    ]
    ax.legend(handles=legend, loc="upper right", fontsize=7, frameon=False)
    note = f"   removed: {', '.join(gone[:8])}{' …' if len(gone) > 8 else ''}" if gone else ""
    ax.set_title((title or "graph after growth") + note, fontsize=9, loc="left")
    fig.tight_layout()
    out = Path(path)
    try:
        kind = diagram_format(out, fmt)
    except InputError:
        plt.close(fig)
        raise
    try:  # through a temp file and a rename, with the modes any new file gets (like every other output)
        atomic_write(out, lambda tmp: fig.savefig(tmp, format=kind))
    finally:
        plt.close(fig)
    return out
