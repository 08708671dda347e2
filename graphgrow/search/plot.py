"""A picture of a search: the metric over epochs for every trial, with exploits and growths marked."""

from __future__ import annotations

from pathlib import Path

from ..core.errors import InputError


def plot_format(path: Path) -> str:
    """The matplotlib format of `path` by its suffix (png without one); InputError when it has none."""
    kind = Path(path).suffix.lstrip(".").lower() or "png"
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise InputError("plotting needs matplotlib", "pip install matplotlib") from e
    supported = Figure().canvas.get_supported_filetypes()
    if kind not in supported:
        raise InputError(f"cannot draw the plot to a .{kind} file", f"use one of .{', .'.join(sorted(supported))}")
    return kind


def plot_population(
    history: dict[str, list[dict]], metric: str, path: str | Path, title: str = "", baseline: list[float] | None = None
) -> Path:
    """PNG (or any format matplotlib writes, by suffix) of `history` (SearchResult.history).

    A growth is a triangle on the trial's curve; an exploit is a circle where the trial continued
    from another one's checkpoint (dotted from the donor's point, the trial's curve broken there);
    `baseline` (one value per epoch) is drawn dashed for comparison."""
    try:
        import matplotlib
    except ImportError as e:
        raise InputError("plotting needs matplotlib", "pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    rows_of = {t: [r for r in rows if metric in r and "epoch" in r] for t, rows in history.items()}
    labelled: set[str] = set()

    def once(label: str) -> str | None:
        if label in labelled:
            return None
        labelled.add(label)
        return label

    for i, (trial, rows) in enumerate(sorted(rows_of.items())):
        if not rows:
            continue
        colour = colours[i % len(colours)]
        segments: list[list[dict]] = [[]]
        for r in rows:
            if "exploit:" in str(r.get("event") or "") and segments[-1]:
                segments.append([])  # the trial now continues another one's run: a new piece of curve
            segments[-1].append(r)
        for j, seg in enumerate(segments):
            ax.plot(
                [r["epoch"] for r in seg],
                [r[metric] for r in seg],
                color=colour,
                linewidth=1.2,
                marker=".",
                markersize=3,
                label=f"{trial} ({int(rows[-1].get('params', 0)):,} params at the end)" if j == 0 else None,
            )
        for r in rows:
            events = [e.split(":", 1) for e in str(r.get("event") or "").split(";") if ":" in e]
            x, y = r["epoch"], r[metric]
            for kind, what in events:
                if kind == "exploit":  # dotted from the donor's point just before, where this trial picked it up
                    before = [d for d in rows_of.get(what, []) if d["epoch"] == x - 1]
                    if before:
                        ax.plot([x - 1, x], [before[-1][metric], y], ":", color=colour, linewidth=1)
                    ax.plot(
                        x,
                        y,
                        "o",
                        markerfacecolor="none",
                        markeredgecolor=colour,
                        markersize=8,
                        label=once("continues from a better trial (exploit)"),
                    )
                elif kind == "grow":
                    ax.plot(
                        x,
                        y,
                        "^",
                        color=colour,
                        markersize=9,
                        markeredgecolor="black",
                        label=once("grew (function-preserving), then trained one epoch"),
                    )
                    ax.annotate(
                        what.split("(")[0], (x, y), textcoords="offset points", xytext=(4, 6), fontsize=7, color=colour
                    )
    if baseline:
        ax.plot(
            range(1, len(baseline) + 1), baseline, "--", color="black", linewidth=1, label="not grown (same epochs)"
        )
    ax.set_xlabel("epoch (the growth or exploit happens just before the marked epoch)")
    ax.set_ylabel(metric)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title or f"population-based growth: {metric} per trial")
    fig.tight_layout()
    out = Path(path)
    from ..io.save import atomic_write

    try:  # staged and renamed like every output; a failed write is SaveError
        atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=110, format=plot_format(out)))
    finally:
        plt.close(fig)
    return out
