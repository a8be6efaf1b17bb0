"""Every script in benchmarks/ runs end to end in its smoke mode (smallest shapes, one repeat) and writes its JSON.

Benchmarks are part of the product and rot when nothing runs them: a refactor that breaks one fails here, in CI,
not in the next person's `make bench`. The figures of a smoke run mean nothing and are not checked; the results go
to a temporary folder (HR_BENCH_RESULTS), never over the committed ones in benchmarks/results/.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_once_more_on_native_abort

BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))
import run_all  # noqa: E402

# One worker runs them all: the scripts build their models and outputs under benchmarks/.cache on first use.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("benchmarks")]


def test_every_script_is_a_listed_benchmark():
    scripts = {p.stem for p in BENCH.glob("*.py")} - run_all.HELPERS
    assert scripts == set(run_all.BENCHMARKS), "a benchmark missing from run_all.BENCHMARKS is never run"


@pytest.mark.parametrize("name", run_all.BENCHMARKS)
def test_benchmark_smoke(name: str, tmp_path: Path):
    env = dict(os.environ, HR_BENCH_RESULTS=str(tmp_path), PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = run_once_more_on_native_abort([sys.executable, str(BENCH / f"{name}.py"), "--smoke"], f"{name}.py --smoke",
                                         cwd=REPO, env=env, timeout=900)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    assert proc.returncode == 0, f"benchmarks/{name}.py --smoke exited {proc.returncode}:\n{tail}"
    result = tmp_path / f"{name}.json"
    assert result.exists(), f"benchmarks/{name}.py --smoke wrote no {result.name}:\n{tail}"
    data = json.loads(result.read_text())
    assert data["meta"]["smoke"] is True
    print(f"{name}: {time.time() - t0:.0f} s")
