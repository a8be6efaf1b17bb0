"""Run every benchmark (quick or full), one after another, and summarise their targets.

    python benchmarks/run_all.py [--quick | --smoke] [--only packing reshard ...]

Each benchmark runs as its own process and writes benchmarks/results/<name>.json (and PNGs); a
failing one is reported and the others still run (exit status 1 if any failed). The summary lists
every target line of every result file: met or MISSED, with the figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# Cheapest first: a broken environment shows up in seconds, not after the vLLM benchmarks.
BENCHMARKS = ["rewards", "startup", "packing", "overhead", "throughput", "reshard", "checkpoint_engine", "scaling",
              "vs_trl", "async", "scale", "lora_sync", "time_to_reward", "tools", "distill", "speculative",
              "prefix_share", "moe_step"]
FULL_ONLY = {"scale", "async", "lora_sync", "time_to_reward", "tools", "distill", "speculative",
             "moe_step"}  # minutes per run: not in `make bench` (--quick)
# the other .py files here: libraries of the benchmarks, not benchmarks
HELPERS = {"common", "qwen_shapes", "run_all", "profile_phases", "distill_kd", "slow_tools"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the quick version of every benchmark")
    p.add_argument("--smoke", action="store_true", help="every benchmark (full-only ones too) in its smoke mode: "
                   "checks they run, in minutes; figures meaningless (make test does this)")
    p.add_argument("--only", nargs="+", choices=BENCHMARKS, help="a subset, in this order")
    a = p.parse_args()
    names = [n for n in BENCHMARKS if (not a.only or n in a.only) and not (a.quick and n in FULL_ONLY)]
    mode = ["--smoke"] if a.smoke else ["--quick"] if a.quick else []
    t_all, walls, failed = time.time(), {}, []
    for name in names:
        cmd = [sys.executable, str(common.HERE / f"{name}.py"), *mode]
        print(f"\n===== {name}: {' '.join(Path(c).name if i < 2 else c for i, c in enumerate(cmd))}", flush=True)
        t0 = time.time()
        code = subprocess.run(cmd, cwd=common.REPO).returncode
        walls[name] = time.time() - t0
        if code != 0:
            failed.append(name)
            print(f"===== {name} FAILED (exit {code})", flush=True)
    total = time.time() - t_all
    print(f"\n===== summary ({(mode or ['full'])[0].lstrip('-')}; {total / 60:.1f} min in all)")
    for name in names:
        status = "FAILED" if name in failed else "ok"
        print(f"{name:11s} {walls[name]:6.0f} s  {status}")
        if name in failed:
            print("           (no new result: the figures in its JSON, if any, are from an earlier run)")
            continue
        targets, headline = _figures(name)
        for t in targets:
            print(f"    {t['verdict']:6s} {t['what']}: {t['value']:.3g} (target {t['target']})")
        for h in headline:
            print(f"    {'':6s} {h['what']}: {h['value']:.3g}")
    sys.exit(1 if failed else 0)


def _figures(name: str) -> tuple[list[dict], list[dict]]:
    """(targets, headline figures) of a result file."""
    path = common.RESULTS / f"{name}.json"
    if not path.exists():
        return [], []
    data = json.loads(path.read_text())
    if name == "rewards":  # written before this harness: rows of pool/serial ratios
        return [], [{"what": f"{r['name']}: pool/serial samples/s", "value": r["ratio"]} for r in data["results"]]
    return data.get("targets", []), data.get("headline", [])


if __name__ == "__main__":
    main()
