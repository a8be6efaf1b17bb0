"""Throughput of the rule-based rewards: the math matcher and the code executor, serial vs. a process pool.

    python benchmarks/rewards.py [--quick] [--workers 2]

Prints a table (samples/s, the pool/serial ratio, and the pool's CPU cost relative to serial) and
writes ``benchmarks/results/rewards.json``. Pool figures exclude the pool's start-up (workers are
started and warmed once per training run) and are the scoring time the pool reports
(``ScoreResult.elapsed_s``). On a shared machine the wall-clock ratio moves with the other load;
the CPU ratio does not.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hybrid_rl.rewards import sandbox
from hybrid_rl.rewards.base import resolve_reward
from hybrid_rl.rewards.pool import RewardPool
from hybrid_rl.rewards.rubric import Rubric, RubricItem

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

RESULTS = common.RESULTS / "rewards.json"

# (response answer, gold): a mix like real MATH / GSM8K batches, right and wrong, plain and symbolic.
_MATH_PAIRS = [
    ("72", "72"), ("1,200", "1200"), ("18.00", "18"), ("\\$5", "5"), ("41", "42"),
    ("\\frac{3}{4}", "0.75"), ("\\dfrac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt2}"), ("2\\pi", "2 \\pi"), ("(1, 2]", "(1,2]"),
    ("\\{1, 2\\}", "\\{2, 1\\}"), ("x^2+2x+1", "(x+1)^2"), ("3\\sqrt{2}", "\\sqrt{18}"), ("50\\%", "0.5"),
    ("\\frac{1}{3}", "0.33"), ("x = 3", "3"), ("(x-1)(x+2)", "x^2+x-2"), ("\\text{(B)}", "B"), ("10^{3}", "1000"),
]  # fmt: skip
_CODE_SOLUTIONS = [
    "n = int(input())\nprint(n * (n + 1) // 2)",  # right
    "n = int(input())\nprint(sum(range(n + 1)))",  # right, slower
    "n = int(input())\nprint(n * n)",  # wrong
    "n = int(input())\nraise SystemExit(n)",  # error
]


@dataclass(frozen=True)
class Row:
    name: str
    samples: int
    serial_per_s: float
    pool_per_s: float
    ratio: float
    cpu_overhead: float  # CPU seconds the pool's workers spent / CPU seconds of the serial run


def _own_cpu_s() -> float:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _workers_cpu_s(pids: list[int]) -> float:
    """utime + stime + the same of reaped children (the sandboxes), from /proc/<pid>/stat."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def _math_batch(n: int) -> tuple[list[str], list[dict[str, str]]]:
    rng = random.Random(0)
    pairs = [rng.choice(_MATH_PAIRS) for _ in range(n)]
    responses = [f"Let us compute step by step ... so the result is \\boxed{{{answer}}}." for answer, _ in pairs]
    return responses, [{"ground_truth": gold} for _, gold in pairs]


def _code_batch(n: int) -> tuple[list[str], list[dict[str, object]]]:
    tests = [{"input": f"{k}\n", "output": str(k * (k + 1) // 2)} for k in (3, 10, 1000)]
    responses = [f"```python\n{_CODE_SOLUTIONS[i % len(_CODE_SOLUTIONS)]}\n```" for i in range(n)]
    return responses, [{"tests": tests}] * n


def _measure(name: str, rubric: Rubric, batch: tuple[list, list], workers: int, repeats: int) -> Row:
    """Serial and pool runs alternate (the machine is shared: both sides then see the same load);
    the best run of each side counts, as the least disturbed one. CPU time is counted too: unlike
    wall time, it does not depend on what else the machine runs."""
    responses, samples = batch
    rubric.warmup()
    rubric.score(responses[:4], samples[:4])  # first-call costs (regex compilation, sandbox probe)
    serial_s, pool_s, serial_cpu, pool_cpu = [], [], 0.0, 0.0
    with RewardPool(rubric, num_workers=workers) as pool:
        pool.submit(responses[: 4 * workers], samples[: 4 * workers]).result(timeout=600)
        pids = [p.pid for p in multiprocessing.active_children()]
        for _ in range(repeats):
            cpu, start = _own_cpu_s(), time.monotonic()
            serial = rubric.score(responses, samples)
            serial_s.append(time.monotonic() - start)
            serial_cpu += _own_cpu_s() - cpu
            cpu = _workers_cpu_s(pids)
            pooled = pool.submit(responses, samples).result(timeout=600)
            pool_cpu += _workers_cpu_s(pids) - cpu
            pool_s.append(pooled.elapsed_s)
            assert pooled.totals == serial.totals, "pool and serial scores differ"
    n = len(responses)
    serial_rate, pool_rate = n / min(serial_s), n / min(pool_s)
    ratio, overhead = round(pool_rate / serial_rate, 2), round(pool_cpu / serial_cpu, 2)
    return Row(name, n, round(serial_rate, 1), round(pool_rate, 1), ratio, overhead)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small batches (~30 s in all)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs per side; the best counts")
    parser.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP)
    args = parser.parse_args()
    n_math, n_code = (400, 24) if args.quick else (2000, 96)
    if args.smoke:
        n_math, n_code, args.repeats = 16, 2, 1
    math_rubric = Rubric([RubricItem("math", resolve_reward("math"))])
    rows = [_measure("math matcher", math_rubric, _math_batch(n_math), args.workers, args.repeats)]
    level = sandbox.isolation_level()
    if level == "bwrap":
        code = Rubric([RubricItem("code", resolve_reward("code", timeout_s=5.0))])
        rows.append(_measure("code executor (3 tests/sample)", code, _code_batch(n_code), args.workers, args.repeats))
    else:
        print(f"skipping the code executor: sandbox isolation here is {level!r}, not 'bwrap'", file=sys.stderr)
    header = f"{'benchmark':34s} {'samples':>8s} {'serial/s':>10s} {f'pool({args.workers})/s':>11s} {'ratio':>6s}"
    print(header + f" {'pool CPU / serial CPU':>22s}")
    for r in rows:
        print(
            f"{r.name:34s} {r.samples:8d} {r.serial_per_s:10.1f} {r.pool_per_s:11.1f} {r.ratio:6.2f} {r.cpu_overhead:22.2f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpus": os.cpu_count(), "workers": args.workers, "quick": args.quick, "smoke": args.smoke, "repeats": args.repeats}
    meta["isolation"] = level
    meta |= {"python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "load_avg": os.getloadavg()}
    RESULTS.write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in rows]}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
