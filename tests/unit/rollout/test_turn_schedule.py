"""The per-trajectory schedule (issue 43, item 7) on a deterministic fake clock: one engine step is one tick, a tool
answers a set number of ticks after its call. A slow tool for one trajectory does not delay another's next turn, the
trained ids, masks and log-probs equal the lockstep loop's on the same model turns, and at TP 2 both ranks add the
same requests at the same engine steps while each runs only its own trajectories' tools."""

from __future__ import annotations

import json
import threading

from hybrid_rl.rollout.chat_template import FAMILIES, ToolSuffix
from hybrid_rl.rollout.multi_turn import TURN_SEED_STRIDE, ToolLoop, TurnLimits, merge_parts
from hybrid_rl.rollout.tool_calls import hermes
from hybrid_rl.rollout.tools._worker import OK
from hybrid_rl.rollout.tools.runner import ToolResult
from hybrid_rl.rollout.trajectory import Trajectory
from hybrid_rl.rollout.turn_schedule import TrajectorySchedule
from hybrid_rl.types import Generation
from tests.unit.rollout.templates import tokenizer_for

TOOL_TICKS = {0: 100, 1: 1, 2: 5}  # trajectory -> how long its tool takes (trajectory 0's is slow)
GEN_TICKS = 3  # engine steps per model turn


class Clock:
    now = 0


def _call(text: str) -> str:
    return f'<tool_call>{json.dumps({"name": "echo", "arguments": {"text": text}})}</tool_call>'


class Model:
    """What trajectory k writes at its turn t: a call at turn 0, an answer at turn 1 (the same on any schedule)."""

    def __init__(self, tok):
        self.tok, self.eot = tok, tok.convert_tokens_to_ids("<|im_end|>")

    def turn(self, key: int, turn: int, budget: int) -> Generation:
        text = _call(f"t{key}") if turn == 0 else f"done {key}"
        ids = (self.tok(text, add_special_tokens=False)["input_ids"] + [self.eot])[:budget]
        return Generation(key, ids, [-0.1 * (key + 1)] * len(ids), "stop")


class FakeEngine:
    """`TurnEngine`: a request finishes `GEN_TICKS` engine steps after it was added (steps, not the clock, as a
    real engine's); records (tick, step, key, context, seed) of each request added."""

    def __init__(self, model, clock):
        self.model, self.clock, self.running, self.added, self.steps = model, clock, {}, [], 0

    def add(self, key, context, max_tokens, seed):
        turn = (seed - 7 * key) // TURN_SEED_STRIDE
        self.added.append((self.clock.now, self.steps, key, tuple(context), seed))
        self.running[key] = (self.steps + GEN_TICKS, self.model.turn(key, turn, max_tokens))

    def busy(self):
        return bool(self.running)

    def step(self):
        self.clock.now += 1
        self.steps += 1
        out = [(k, g) for k, (due, g) in self.running.items() if due <= self.steps]
        for k, _ in out:
            del self.running[k]
        return out


class FakeRunner:
    restarts, env_methods = 0, set()

    def run(self, requests):
        return [ToolResult(f"echo {r.call.arguments['text']}", OK) for r in requests]


class FakeTools:
    """`ToolPool` on the fake clock: trajectory k's calls answer `TOOL_TICKS[k]` ticks after they were sent; a
    wait (the engine idle) moves the clock to the first answer."""

    def __init__(self, clock):
        self.clock, self.runner, self.pending, self.sent = clock, FakeRunner(), {}, []

    def submit(self, key, requests):
        self.sent.append(key)
        self.pending[key] = (self.clock.now + TOOL_TICKS[key], self.runner.run(requests))

    def done(self, wait):
        if wait != 0 and self.pending and not any(due <= self.clock.now for due, _ in self.pending.values()):
            self.clock.now = min(due for due, _ in self.pending.values())
        out = {k: res for k, (due, res) in self.pending.items() if due <= self.clock.now}
        for k in out:
            del self.pending[k]
        return out


def _loop(tok):
    return ToolLoop(tok, ToolSuffix(tok, FAMILIES["chatml"]), hermes, FakeRunner(), TurnLimits(3, 3, 32, 200))


def _trajectories(tok, n=3):
    return [Trajectory(tok(f"<|im_start|>user\nq{k}<|im_end|>\n<|im_start|>assistant\n",
                           add_special_tokens=False)["input_ids"]) for k in range(n)]


def _scheduled(tok, share=None, clock=None):
    clock = clock or Clock()
    engine, tools, trajs = FakeEngine(Model(tok), clock), FakeTools(clock), _trajectories(tok)
    TrajectorySchedule(_loop(tok), sync_every=4).run(trajs, [None] * 3, engine, tools, [7 * k for k in range(3)],
                                                     share)
    return trajs, engine, tools


def test_a_slow_tool_does_not_delay_another_trajectorys_next_turn():
    tok = tokenizer_for("qwen2.5")
    trajs, engine, _ = _scheduled(tok)
    second_turn = {key: tick for tick, _, key, _, seed in engine.added if seed >= TURN_SEED_STRIDE}
    # every first turn ends at tick 3; trajectory 1's tool answers at 4 and its next turn goes in at once, while
    # trajectory 0's tool runs until tick 103 (lockstep: every second turn would wait for it)
    assert second_turn[1] == GEN_TICKS + TOOL_TICKS[1]
    assert second_turn[2] == GEN_TICKS + TOOL_TICKS[2]
    assert second_turn[0] == GEN_TICKS + TOOL_TICKS[0]
    assert all(t.done and t.turns == 2 and t.tool_calls == 1 for t in trajs)


def test_the_trained_ids_masks_and_logprobs_equal_the_lockstep_loops():
    tok = tokenizer_for("qwen2.5")
    trajs, _, _ = _scheduled(tok)
    lockstep, model = _trajectories(tok), Model(tok)

    def generate(contexts, budgets, seeds):
        return [model.turn(k, s // TURN_SEED_STRIDE, b) for k, (b, s) in enumerate(zip(budgets, seeds, strict=True))]

    _loop(tok).run(lockstep, [None] * 3, generate, [k for k in range(3)])
    for a, b in zip(trajs, lockstep, strict=True):
        assert (a.response_ids, a.loss_mask, a.logprobs, a.turns) == (b.response_ids, b.loss_mask, b.logprobs, b.turns)
        assert "echo t" in tok.decode(a.response_ids) and a.loss_mask.count(False) > 0


class ThreadShare:
    """`ToolShare` between two threads standing for the two ranks of a TP group (an all-gather by a barrier)."""

    def __init__(self, rank, parts, barrier, calls):
        self.rank, self.parts, self.barrier, self.calls = rank, parts, barrier, calls

    def owns(self, i):
        return i % 2 == self.rank

    def exchange(self, mine, check):
        self.calls.append(check)
        self.parts[self.rank] = (check, mine)
        self.barrier.wait()
        out = merge_parts(list(self.parts))
        self.barrier.wait()
        return out


def test_at_tp_2_both_ranks_add_the_same_requests_at_the_same_steps_and_run_only_their_own_tools():
    tok = tokenizer_for("qwen2.5")
    parts, barrier, results = [None, None], threading.Barrier(2), {}
    calls = {0: [], 1: []}

    def rank(r):
        results[r] = _scheduled(tok, ThreadShare(r, parts, barrier, calls[r]))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    (t0, e0, tools0), (t1, e1, tools1) = results[0], results[1]
    assert [a[1:] for a in e0.added] == [a[1:] for a in e1.added]  # same requests, in the same order
    assert sorted(tools0.sent) == [0, 2] and tools1.sent == [1]  # each trajectory's tools on its owner alone
    assert [t.response_ids for t in t0] == [t.response_ids for t in t1]
    assert [t.response_ids for t in t0] == [t.response_ids for t in _scheduled(tok)[0]]
    # few exchanges: at agreed boundaries only (every 4 steps while one waits, and when the engine idles)
    assert len(calls[0]) == len(calls[1]) <= 8


class SlowAndFast:
    """An environment whose `slow` method takes a while and `fast` returns at once."""

    def __init__(self, gate):
        self.gate = gate

    def slow(self):
        self.gate.wait(5)
        return "slow"

    def fast(self):
        return "fast"


def test_the_sidecars_batcher_answers_each_trajectory_on_its_own():
    """A trajectory whose tool is slow holds no other: the fast call is answered while the slow one still runs."""
    from hybrid_rl.rollout.tool_calls import ToolCall
    from hybrid_rl.rollout.tools.batcher import ToolBatcher
    from hybrid_rl.rollout.tools.runner import ToolRequest, ToolRunner

    gate = threading.Event()
    env = SlowAndFast(gate)
    batcher = ToolBatcher(ToolRunner([], ("slow", "fast"), workers=1, timeout_s=10.0))
    got = {}
    slow = threading.Thread(target=lambda: got.update(slow=batcher.run([ToolRequest(ToolCall("slow", {}), env)])))
    try:
        slow.start()
        fast = batcher.run([ToolRequest(ToolCall("fast", {}), env)])
        assert [r.text for r in fast] == ["fast"] and "slow" not in got  # answered before the slow call ended
        gate.set()
        slow.join(timeout=10)
        assert [r.text for r in got["slow"]] == ["slow"]
    finally:
        gate.set()
        batcher.close()


def test_the_runner_sized_from_the_batch_serves_calls_from_several_threads_at_once():
    """`tool_workers=0`: as many workers as trajectories (`size_for`); calls from threads share them, each with its
    own clock: three 1 s calls sent from three threads take about 1 s, not 3, and each returns its own text."""
    import time

    from hybrid_rl.rollout.tool_calls import ToolCall
    from hybrid_rl.rollout.tools import ToolRequest, ToolRunner, resolve_tools

    runner = ToolRunner(resolve_tools(["tests.unit.rollout.tool_fns:hang", "tests.unit.rollout.tool_fns:echo"]),
                        workers=0, timeout_s=10.0)
    runner.size_for(3)
    try:
        assert runner.workers == 3
        runner.run([ToolRequest(ToolCall("echo", {"text": "warm"}))])  # the workers start
        out = {}

        def call(k):
            out[k] = runner.run([ToolRequest(ToolCall("hang", {"seconds": 1.0})),
                                 ToolRequest(ToolCall("echo", {"text": f"t{k}"}))])

        start = time.monotonic()
        threads = [threading.Thread(target=call, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        took = time.monotonic() - start
        assert [out[k][1].text for k in range(3)] == ["t0", "t1", "t2"]
        assert all(out[k][0].status == OK for k in range(3)) and took < 2.5
    finally:
        runner.close()
