"""How the RL step time grows with response length, batch size (prompts per step) and model size.

    python benchmarks/scaling.py [--quick] [--recipe grpo] [--lengths 32 64 128 256] \\
        [--prompts 2 4 8 16] [--sizes 4M 12M 25M]

Each axis is varied from a base point (the first value of every list) with the others held at
their base; every point runs the trainer for `--steps` steps (the first a warm-up) in one torchrun
launch of 2 ranks, phases read from metrics.jsonl as in `throughput.py`. Each point's step time is
reported as a ratio to the base point's, next to the ratio of the work it does (prompt+response
tokens for length and batch, tokens x N for model size): a time ratio below the work ratio means
fixed costs are being amortised. In full mode the base point runs again at the end, and the drift
between its two runs is reported (the points cannot alternate: each is a whole trainer run).
Writes benchmarks/results/scaling.json and scaling.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import throughput  # noqa: E402


def points(a) -> list[dict]:
    base = {"length": a.lengths[0], "prompts": a.prompts[0], "size": a.sizes[0]}
    out = [dict(base, axis="base")]
    out += [dict(base, axis="length", length=v) for v in a.lengths[1:]]
    out += [dict(base, axis="prompts", prompts=v) for v in a.prompts[1:]]
    out += [dict(base, axis="size", size=v) for v in a.sizes[1:]]
    if not a.quick:
        out.append(dict(base, axis="base_again"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 points per axis, 2 steps each (~3 min)")
    p.add_argument("--recipe", default="grpo")
    p.add_argument("--lengths", nargs="+", type=int, help="max new tokens (default 32 64 quick, 32 64 128 256 full)")
    p.add_argument("--prompts", nargs="+", type=int, help="prompts per step (default 4 8 quick, 2 4 8 16 full)")
    p.add_argument("--sizes", nargs="+", choices=sorted(common.SIZES), help="default 4M 12M quick, 4M 12M 25M full")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--steps", type=int, help="steps per point incl. the warm-up (default 2 quick, 4 full)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP)
    a = p.parse_args()
    if a.smoke:  # a base point and one point on the length axis, 2 steps each, in one launch
        a.quick, a.lengths, a.prompts, a.sizes, a.n, a.steps = True, [4, 8], [2], ["4M"], 2, 2
    a.lengths = a.lengths or ([32, 64] if a.quick else [32, 64, 128, 256])
    a.prompts = a.prompts or ([4, 8] if a.quick else [2, 4, 8, 16])
    a.sizes = a.sizes or (["4M", "12M"] if a.quick else ["4M", "12M", "25M"])
    a.steps = a.steps or (2 if a.quick else 4)
    pts = points(a)
    runs = []
    for i, pt in enumerate(pts):
        out = common.CACHE / "runs" / f"scaling_{i}"
        throughput._clean(out)
        overrides = throughput.run_overrides(str(common.sized_model(pt["size"])), out, prompts=pt["prompts"], n=a.n,
                                             max_new_tokens=pt["length"], steps=a.steps, extra=a.set)
        runs.append({"name": f"{pt['axis']}:{pt['size']},p{pt['prompts']},len{pt['length']}", "recipe": a.recipe,
                     "overrides": overrides})
    summaries = throughput.launch(runs, nproc=2, tag="scaling")
    rows = table_rows(pts, summaries)
    report(rows, a)


def table_rows(pts: list[dict], summaries: list[dict]) -> list[dict]:
    base = summaries[0]
    base_work = base["all_tokens"] * base["flops_n"]
    rows = []
    for pt, s in zip(pts, summaries, strict=True):
        ph = s["phases_s"]
        rows.append(dict(pt, params_m=s["params"] / 1e6, step_s=s["step_s"], time_ratio=s["step_s"] / base["step_s"],
                         work_ratio=s["all_tokens"] * s["flops_n"] / base_work, tokens=s["all_tokens"],
                         generate_s=ph["generate"], update_s=ph["update"],
                         passes_s=ph["old_logp"] + ph["reference"], sync_s=ph["sync"] + ph["switch"],
                         step_over_floor=s["step_over_floor"], summary=s))
    return rows


def report(rows: list[dict], a) -> None:
    print(f"\n{a.recipe}, 2 ranks, n={a.n}; step time per point (median of {a.steps - 1} step(s) after a warm-up)")
    print(common.table(rows, [("axis", "axis", "s"), ("size", "model", "s"), ("prompts", "prompts", "d"),
                              ("length", "max new", "d"), ("tokens", "tokens/step", ".0f"),
                              ("step_s", "s/step", ".2f"), ("time_ratio", "time x base", ".2f"),
                              ("work_ratio", "work x base", ".2f"), ("generate_s", "generate s", ".2f"),
                              ("passes_s", "old+ref s", ".2f"), ("update_s", "update s", ".2f"),
                              ("sync_s", "sync+switch s", ".2f"), ("step_over_floor", "step/floor", ".1f")]))
    again = [r for r in rows if r["axis"] == "base_again"]
    drift = again[0]["step_s"] / rows[0]["step_s"] if again else None
    if drift is not None:
        print(f"  drift: the base point's second run took {drift:.2f}x its first (machine load changed by that much)")
    else:
        print("  (quick mode: the base point is not re-run, so load drift between points is not measured)")
    png = common.RESULTS / "scaling.png"
    plot(rows, png)
    headline = [{"what": f"step time x base at {r['axis']} {r['size']} p{r['prompts']} len{r['length']} "
                         f"(work x{r['work_ratio']:.2f})", "value": r["time_ratio"]} for r in rows[1:]]
    common.write_result("scaling", {"rows": [{k: v for k, v in r.items() if k != "summary"} for r in rows],
                                    "headline": headline,
                                    "summaries": [r["summary"] for r in rows], "drift": drift,
                                    "settings": {"recipe": a.recipe, "n": a.n, "steps": a.steps, "overrides": a.set}},
                        quick=a.quick)


def plot(rows: list[dict], png: Path) -> None:
    """One panel per axis: step time and its main phases against the varied quantity."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    base = rows[0]
    axes_spec = [("length", "max new tokens", "length"), ("prompts", "prompts per step", "prompts"),
                 ("size", "model parameters (M)", "params_m")]
    fig = Figure(figsize=(13, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    panels = fig.subplots(1, 3)
    for ax, (axis, label, xkey) in zip(panels, axes_spec, strict=True):
        pts = sorted([base] + [r for r in rows if r["axis"] == axis], key=lambda r: r[xkey])
        xs = [r[xkey] for r in pts]
        for key, name, style in (("step_s", "step", "o-"), ("generate_s", "generate", "s--"),
                                 ("update_s", "update", "^--"), ("passes_s", "old-logp + reference", "v--"),
                                 ("sync_s", "sync + switch", "x:")):
            ax.plot(xs, [r[key] for r in pts], style, label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3)
        ax.set_title(f"step time vs {label}")
    panels[0].legend(fontsize=8)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"wrote {common._shown(png)}")


if __name__ == "__main__":
    main()
