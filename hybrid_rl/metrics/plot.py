"""Plot metrics.jsonl: one subplot per metric against step, as a PNG (headless: Agg canvas, no pyplot)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hybrid_rl.metrics.jsonl import read_records

DEFAULT_KEYS = ("reward/mean", "actor/kl", "response/length_mean")


def plot_metrics(jsonl_path: str | Path, png_path: str | Path, keys: Sequence[str] = DEFAULT_KEYS, *,
                 title: str | None = None) -> Path:
    """Write `png_path` with a subplot for each of `keys` present in the file (absent keys are skipped)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    records = read_records(jsonl_path)
    series = {}
    for key in keys:
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]  # null = non-finite: a gap
        if points:
            series[key] = points
    if not series:
        available = sorted({k for r in records for k in r} - {"step"})
        raise ValueError(f"none of {list(keys)} is in {jsonl_path} ({len(records)} records); "
                         f"pass keys from: {available}")
    # A Figure on its own Agg canvas: no pyplot global state, no display needed, safe in threads.
    fig = Figure(figsize=(7, 2.4 * len(series)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, points) in zip(axes, series.items(), strict=True):
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, marker="." if len(points) < 50 else None, linewidth=1.2)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title)
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out
