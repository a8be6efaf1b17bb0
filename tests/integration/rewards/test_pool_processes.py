"""``RewardPool`` under a parent process that is SIGKILLed: its reward workers do not outlive it."""

import signal
import subprocess
import sys
import time

from tests.integration.rewards.test_pool import _alive


def test_workers_exit_when_their_parent_is_killed(tmp_path):
    """An orphaned reward worker must not outlive a SIGKILLed trainer rank (nor hold its output pipe)."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import time\n"
        "from hybrid_rl.rewards import RewardPool, Rubric, RubricItem, resolve_reward\n"
        "if __name__ == '__main__':\n"
        "    pool = RewardPool(Rubric([RubricItem('m', resolve_reward('math'))]), 1, timeout_s=5)\n"
        "    pool.submit(['1'], [{'ground_truth': '1'}]).result(60)\n"
        "    print(' '.join(map(str, pool._executor._processes)), flush=True)\n"
        "    time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workers = [int(x) for x in proc.stdout.readline().split()]
    assert workers
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while _alive(workers) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(workers), f"orphaned reward workers still running: {_alive(workers)}"
