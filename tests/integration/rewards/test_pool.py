"""``RewardPool``: scoring in spawned worker processes, with bounded time and no leaked processes."""

import multiprocessing
import threading
import time

import pytest

from hybrid_rl.rewards import _pool_worker
from hybrid_rl.rewards.base import resolve_reward
from hybrid_rl.rewards.pool import RewardPool
from hybrid_rl.rewards.rubric import Rubric, RubricItem

RESPONSES = ["<think>a</think><answer>\\boxed{4}</answer>", "#### 5", r"\boxed{\frac12}", "nothing"]
SAMPLES = [{"ground_truth": "4"}, {"ground_truth": "4"}, {"ground_truth": "0.5"}, {"ground_truth": "1"}]


def _user(module, *names, weight=1.0):
    return [RubricItem(n, resolve_reward(f"{module}:{n}"), weight) for n in names]


def _alive(pids):
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


def test_pool_scores_like_the_inline_rubric():
    rubric = Rubric(
        [RubricItem("math", resolve_reward("math"), 1.0), RubricItem("format", resolve_reward("format"), 0.5)]
    )
    expected = rubric.score(RESPONSES, SAMPLES)
    with RewardPool(rubric, num_workers=2) as pool:
        result = pool.submit(RESPONSES, SAMPLES).result(timeout=60)
    assert result.totals == expected.totals == [1.5, 0.0, 1.0, 0.0]
    assert result.by_name == expected.by_name
    assert result.num_errors == result.num_timeouts == 0


def test_submit_returns_at_once_and_result_waits(user_rewards_module):
    rubric = Rubric(_user(user_rewards_module, "slow"))
    with RewardPool(rubric, num_workers=2) as pool:
        start = time.monotonic()
        handle = pool.submit(["a"] * 4, [{"sleep": 0.3}] * 4)
        assert time.monotonic() - start < 0.1 and not handle.done()
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.01)
        result = handle.result(timeout=30)
    assert result.totals == [1.0] * 4
    assert 0.5 < result.elapsed_s < 10  # 4 x 0.3 s on 2 workers


def test_errors_and_non_finite_rewards_are_counted_not_raised(user_rewards_module):
    rubric = Rubric(_user(user_rewards_module, "length", "boom", "nan"))
    with RewardPool(rubric, num_workers=2) as pool:
        result = pool.submit(["abcd", "ab"], [{}, {}]).result(timeout=60)
    assert result.totals == pytest.approx([0.4, 0.2])
    assert result.num_errors == 4 and result.num_timeouts == 0
    assert {(f.index, f.name, f.kind) for f in result.failures} == {
        (0, "boom", "error"), (1, "boom", "error"), (0, "nan", "nonfinite"), (1, "nan", "nonfinite"),
    }  # fmt: skip


def test_reward_over_the_time_limit_scores_zero_as_a_timeout(user_rewards_module):
    rubric = Rubric(_user(user_rewards_module, "length", "sleep_forever"))
    with RewardPool(rubric, num_workers=2, timeout_s=0.5) as pool:
        start = time.monotonic()
        result = pool.submit(["abcd", "ab"], [{}, {}]).result(timeout=60)
    assert time.monotonic() - start < 10
    assert result.totals == pytest.approx([0.4, 0.2])
    assert result.num_timeouts == 2 and result.num_errors == 0


def test_stuck_worker_is_replaced_and_the_pool_keeps_working(user_rewards_module):
    rubric = Rubric(_user(user_rewards_module, "stuck_in_c"))
    with RewardPool(rubric, num_workers=2, timeout_s=0.5, hard_timeout_s=2.0) as pool:
        first = pool.submit(["ok", "stuck", "ok", "ok"], [{}] * 4).result(timeout=60)
        second = pool.submit(["ok", "ok"], [{}] * 2).result(timeout=60)
    assert first.totals == [1.0, 0.0, 1.0, 1.0]
    assert first.num_timeouts == 1 and first.failures[0].index == 1
    assert second.totals == [1.0, 1.0]


def test_crashed_worker_is_an_error_for_its_sample_only(user_rewards_module):
    rubric = Rubric(_user(user_rewards_module, "crash"))
    with RewardPool(rubric, num_workers=2) as pool:
        result = pool.submit(["ok", "crash", "ok"], [{}] * 3).result(timeout=120)
        again = pool.submit(["ok"], [{}]).result(timeout=60)
    assert result.totals == [1.0, 0.0, 1.0]
    assert [(f.index, f.kind) for f in result.failures] == [(1, "error")]
    assert again.totals == [1.0]


@pytest.mark.parametrize("board_names_it", [True, False], ids=["board-names-the-sample", "board-cannot-tell"])
def test_samples_in_flight_beside_a_crash_are_not_blamed_for_it(user_rewards_module, monkeypatch, board_names_it):
    # The crash comes while the other worker is inside an "ok" sample, so every round of the old
    # retry-together scheme broke the bystander as well and it ended as an error too. A worker that
    # dies between samples leaves no name on the board: then every unfinished sample is retried alone.
    if not board_names_it:
        monkeypatch.setattr(RewardPool, "_samples_of_dead_workers", lambda self, executor: set())
    rubric = Rubric(_user(user_rewards_module, "crash"))
    samples = [{"sleep": 0.6}, {"sleep": 0.1}, {"sleep": 0.6}, {"sleep": 0.6}]
    with RewardPool(rubric, num_workers=2) as pool:
        result = pool.submit(["ok", "crash", "ok", "ok"], samples).result(timeout=120)
    assert result.totals == [1.0, 0.0, 1.0, 1.0]
    assert [(f.index, f.kind) for f in result.failures] == [(1, "error")]


def test_only_the_sample_a_worker_died_on_is_scored_again_alone(user_rewards_module, monkeypatch):
    # The progress board names the sample the dead worker was on; the other unfinished samples
    # (here the other worker's, broken mid-sample) go back to the parallel queue.
    sent_alone = []
    send = RewardPool._send

    def spy(self, batch, indices, *, alone=False):
        if alone:
            sent_alone.append(indices)
        send(self, batch, indices, alone=alone)

    monkeypatch.setattr(RewardPool, "_send", spy)
    rubric = Rubric(_user(user_rewards_module, "crash"))
    responses = ["ok", "crash"] + ["ok"] * 10
    samples = [{"sleep": 0.6}, {"sleep": 0.2}] + [{"sleep": 0.2}] * 10
    with RewardPool(rubric, num_workers=2) as pool:
        result = pool.submit(responses, samples).result(timeout=120)
    assert result.totals == [1.0, 0.0] + [1.0] * 10
    assert [(f.index, f.kind) for f in result.failures] == [(1, "error")]
    assert sent_alone == [(1,)]  # blamed once from the board, once more alone, then an error


def test_zero_workers_scores_inline(user_rewards_module):
    rubric = Rubric(_user(user_rewards_module, "length"))
    before = set(multiprocessing.active_children())
    with RewardPool(rubric, num_workers=0) as pool:
        handle = pool.submit(["abc"], [{}])
        assert handle.done()
        assert handle.result().totals == pytest.approx([0.3])
        assert set(multiprocessing.active_children()) <= before


def test_close_leaves_no_worker_process(user_rewards_module):
    pool = RewardPool(Rubric(_user(user_rewards_module, "length")), num_workers=2)
    pids = [p.pid for p in multiprocessing.active_children()]
    assert len(pids) >= 2
    pool.submit(["a"], [{}]).result(timeout=30)
    pool.close()
    assert _alive(pids) == []
    assert multiprocessing.active_children() == []  # reaped too, not just dead


def test_close_reaps_the_workers_of_replaced_pools_too(user_rewards_module):
    rubric = Rubric(_user(user_rewards_module, "crash"))
    for _ in range(3):  # reaping raced the executor's own thread: a few rounds made a leftover likely
        with RewardPool(rubric, num_workers=2) as pool:
            assert pool.submit(["crash", "ok"], [{}] * 2).result(timeout=120).totals == [0.0, 1.0]
        assert multiprocessing.active_children() == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(["a"], [{}])


def test_workers_do_not_import_torch(user_rewards_module):
    with RewardPool(Rubric(_user(user_rewards_module, "torch_loaded")), num_workers=1) as pool:
        assert pool.submit(["a"], [{}]).result(timeout=30).totals == [0.0]


def test_lambda_rewards_are_rejected_with_a_hint():
    with pytest.raises(ValueError, match="lambdas"):
        RewardPool(Rubric([RubricItem("l", lambda r, s: 1.0)]), num_workers=1)


def test_rewards_defined_in_main_are_rejected(user_rewards_module):
    fn = resolve_reward(f"{user_rewards_module}:length")
    fake = type(fn)(fn.__code__, fn.__globals__, "length")
    fake.__module__ = "__main__"
    with pytest.raises(ValueError, match="__main__"):
        RewardPool(Rubric([RubricItem("x", fake)]), num_workers=1)


def test_fork_start_method_is_refused(user_rewards_module):
    with pytest.raises(ValueError, match="fork is unsafe"):
        RewardPool(Rubric(_user(user_rewards_module, "length")), num_workers=1, start_method="fork")


def test_mismatched_batch_is_rejected(user_rewards_module):
    with RewardPool(Rubric(_user(user_rewards_module, "length")), num_workers=0) as pool:
        with pytest.raises(ValueError, match="2 responses but 1 samples"):
            pool.submit(["a", "b"], [{}])


def test_progress_board_left_locked_by_a_dead_worker_does_not_hang_the_parent():
    board = multiprocessing.get_context("spawn").Array("d", [1234.0, 3.0, time.monotonic() - 60.0])  # pid, index, start
    assert _pool_worker.stuck_samples(board, limit_s=1.0) == [3]
    holder = threading.Thread(target=board.get_lock().acquire)  # takes the lock and never gives it back
    holder.start()
    holder.join()
    start = time.monotonic()
    assert _pool_worker.stuck_samples(board, limit_s=1.0) == []
    assert time.monotonic() - start < 10
