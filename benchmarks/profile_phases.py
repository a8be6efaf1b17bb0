"""Split py-spy profiles of a training rank by step phase and name the top costs of each.

    pip install py-spy                      # a profiler, not a dependency of the project
    python benchmarks/throughput.py ... --steps 8 &                        # any run of the trainer
    py-spy record --pid RANK_PID --duration 40 --rate 20 --native -f raw -o rank0.txt   # after step 1
    python benchmarks/profile_phases.py rank0.txt [rank1.txt ...] [--top 8]

A sample belongs to the phase whose trainer function is on its stack (generation, the weight sync, the
no-grad passes, the update, validation); samples of other threads (gloo, vLLM's helpers, idle pools) have
no trainer frame and are left out. Per phase: its share of the samples, then the deepest Python frames and
the native leaf functions that hold the most samples (`--native`; without it the Python frames only).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

# (function on the stack -> phase); the first match, from this list's top, wins.
PHASE_MARKERS = [
    ("Trainer._validate", "validate"),
    ("sync_weights", "sync"),
    ("_GeneratorContextManager.__enter__", "sync"),  # the rollout session's start: the weight sync
    ("Sampler.generate", "generate"),
    ("Trainer._passes", "passes (reference / old log-probs)"),
    ("update_actor", "update"),
    ("Trainer.step", "other"),
]


KERNEL = re.compile(r"(\w+_kernel|\w+gemm\w*|munmap|memset|memcpy\w*)\b")


def native_name(frames: list[str]) -> str:
    """The deepest named kernel (a TensorIterator loop's leaf names only its template), else the leaf."""
    for f in reversed(frames):
        if m := KERNEL.search(f):
            return m.group(1)
    return frames[-1]


def phase_of(functions: list[str]) -> str | None:
    names = set(functions)
    return next((phase for marker, phase in PHASE_MARKERS if marker in names), None)


def split(paths: list[Path]) -> tuple[Counter, dict[str, Counter], dict[str, Counter]]:
    """(samples per phase, deepest Python frame counts per phase, native leaf counts per phase)."""
    total: Counter = Counter()
    python: dict[str, Counter] = defaultdict(Counter)
    native: dict[str, Counter] = defaultdict(Counter)
    for path in paths:
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            phase = phase_of([f.split(" ")[0] for f in frames])
            if phase is None:
                continue
            n = int(count)
            total[phase] += n
            py = [f for f in frames if ".py:" in f]
            nat = [f for f in frames if ".py:" not in f and not f.startswith("<frozen")]
            python[phase][py[-1] if py else "-"] += n
            if nat:
                native[phase][native_name(nat)] += n
    return total, python, native


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profiles", nargs="+", type=Path, help="py-spy raw (collapsed) output files")
    p.add_argument("--top", type=int, default=8)
    a = p.parse_args()
    total, python, native = split(a.profiles)
    n_all = sum(total.values()) or 1
    for phase, n in total.most_common():
        print(f"{phase}: {n} samples, {n / n_all:.0%} of the trainer's")
        for frame, c in python[phase].most_common(a.top):
            print(f"    {c / n:5.0%}  py  {frame[:120]}")
        for frame, c in native[phase].most_common(a.top):
            print(f"    {c / n:5.0%}  nat {frame[:120]}")


if __name__ == "__main__":
    main()
