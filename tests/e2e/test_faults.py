"""Faults end well: SIGKILL at any moment (also mid-checkpoint) resumes to the same result, SIGTERM saves
and exits 0, non-finite steps are skipped then stop the run, broken rewards are counted, an exhausted
dynamic sampler says so."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, TIMING
from tests.e2e.conftest import tiny_overrides

pytestmark = [pytest.mark.slow, TIMING]  # signals at moments read off the clock
STEPS = 6
KEYS = ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "response/length_mean")


def launch(overrides: list[str], *, env: dict | None = None, recipe: str = "grpo") -> subprocess.Popen:
    """torchrun with 2 ranks in its own session (so the test can signal the whole job)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "hybrid_rl.train", f"--config-name={recipe}", *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, **(env or {})), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: int = 600) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def metrics(out: Path) -> dict[int, dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if max(metrics(out), default=0) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def overrides_for(tiny_models, task_files, out: Path, **extra) -> list[str]:
    return tiny_overrides(tiny_models["qwen2"], task_files, out, **{
        "trainer.total_steps": STEPS, "trainer.save_every": 2, "trainer.seed": 5, "data.val_files": "[]",
        "reward.fn": "tests.e2e.rewards:length_parity", **extra})


@pytest.fixture(scope="module")
def straight_run(tiny_models, task_files, tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("straight")
    rc, log = finish(launch(overrides_for(tiny_models, task_files, out)))
    assert rc == 0, log[-3000:]
    return metrics(out)


def test_sigkill_at_an_arbitrary_moment_then_resume_gives_the_same_final_metrics(
        straight_run, tiny_models, task_files, tmp_path):
    out = tmp_path / "run"
    proc = launch(overrides_for(tiny_models, task_files, out))
    wait_for_step(out, 3, proc)
    time.sleep(random.uniform(0.0, 1.5))  # somewhere in step 4 or 5: rollout, update or checkpoint
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    rc, log = finish(launch(overrides_for(tiny_models, task_files, out, **{"trainer.resume": "auto"})))
    assert rc == 0, log[-3000:]
    assert "resumed from the checkpoint of step" in log
    resumed = metrics(out)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for key in KEYS:
        assert resumed[STEPS][key] == straight_run[STEPS][key], key


def test_sigkill_during_a_checkpoint_write_leaves_the_previous_checkpoint_in_use(
        straight_run, tiny_models, task_files, tmp_path):
    out = tmp_path / "run"
    rc, log = finish(launch(overrides_for(tiny_models, task_files, out), env={"HYBRID_RL_FAULT": "checkpoint_write:4"}))
    assert rc != 0
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_2", "step_4.tmp"], ckpts  # the half-written one was never published
    rc, log = finish(launch(overrides_for(tiny_models, task_files, out, **{"trainer.resume": "auto"})))
    assert rc == 0, log[-3000:]
    assert "resumed from the checkpoint of step 2" in log
    assert "step_4.tmp" not in {p.name for p in (out / "checkpoints").iterdir()}
    resumed = metrics(out)
    for key in KEYS:
        assert resumed[STEPS][key] == straight_run[STEPS][key], key


@pytest.fixture(scope="module")
def sigterm_run(tiny_models, task_files, tmp_path_factory) -> tuple[int, str, Path]:
    """One launch for two tests: a long run whose every reward is NaN, stopped with SIGTERM after step 2."""
    out = tmp_path_factory.mktemp("sigterm") / "run"
    proc = launch(overrides_for(tiny_models, task_files, out, **{
        "trainer.total_steps": 200, "trainer.save_every": 0, "reward.fn": "tests.e2e.rewards:not_a_number"}))
    try:
        wait_for_step(out, 2, proc)
        # A scheduler signals every process of the job; the workers save, say how to resume and exit 0.
        for child in psutil.Process(proc.pid).children():
            child.send_signal(signal.SIGTERM)
        rc, log = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc, log, out


def test_sigterm_saves_a_checkpoint_at_the_step_boundary_and_exits_0(sigterm_run):
    rc, log, out = sigterm_run
    assert rc == 0, log[-3000:]
    assert "checkpoint saved. Resume with the same command" in log
    last = max(metrics(out))
    assert (out / "checkpoints" / f"step_{last}" / "COMPLETE").exists()


def test_non_finite_steps_are_skipped_then_stop_the_run_with_the_checkpoint_intact(tiny_models, task_files, tmp_path):
    out = tmp_path / "run"
    # An absurd entropy bonus overflows the gradient norm to inf at every step: nothing may be applied.
    rc, log = finish(launch(overrides_for(tiny_models, task_files, out, **{
        "algorithm.entropy_coef": "1e38", "trainer.max_bad_steps": 3, "trainer.total_steps": 10})))
    assert rc != 0
    assert "3 non-finite steps in a row" in log
    m = metrics(out)
    assert [m[s]["train/skipped_steps"] for s in (1, 2)] == [1.0, 2.0]
    assert (out / "checkpoints" / "step_2" / "COMPLETE").exists()


def test_nan_rewards_count_as_errors_of_that_reward_and_never_reach_the_advantages(sigterm_run):
    rc, log, out = sigterm_run  # the run went on through its NaN rewards until it was stopped
    assert rc == 0, log[-3000:]
    m = metrics(out)[1]
    assert m["reward/errors"] == 16 and m["reward/mean"] == 0.0  # 4 prompts x 4 samples, each an error
    assert m["actor/pg_loss"] == 0.0


def test_dynamic_sampling_that_finds_no_signal_stops_with_a_clear_error(tiny_models, task_files, tmp_path):
    out = tmp_path / "run"
    rc, log = finish(launch(overrides_for(tiny_models, task_files, out, **{
        "reward.fn": "tests.e2e.rewards:constant", "algorithm.overlong_buffer": 4,
        "algorithm.max_sampling_rounds": 2}), recipe="dapo"))
    assert rc != 0
    assert "dynamic sampling kept no group in 2 rounds" in log
