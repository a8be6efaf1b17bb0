"""The colocated multi-turn rollout worker on a scripted engine: trajectories become samples with their loss masks
and fields, an infrastructure failure is dropped before group statistics (the rest renumbered), metrics add up. (At TP 2, two gloo processes: tests/integration/colocated/test_multi_turn_tp.py.)"""


import pytest
import torch

from hybrid_rl.algos.advantages import grpo
from hybrid_rl.colocated.multi_turn import MultiTurnRollout
from hybrid_rl.colocated.sampler import Sampler
from hybrid_rl.data.records import PromptRecord, ReadOnlyFields
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.rollout.agentic import AgentSetup
from hybrid_rl.rollout.chat_template import FAMILIES, ToolSuffix
from hybrid_rl.rollout.environment import open_environment
from hybrid_rl.rollout.multi_turn import ToolLoop, TurnLimits, merge_parts
from hybrid_rl.rollout.sampling import SamplingSettings
from hybrid_rl.rollout.tool_calls import hermes
from hybrid_rl.rollout.tools import ToolRunner, load_environment, resolve_tools
from hybrid_rl.types import Generation
from tests.unit.rollout.templates import tokenizer_for

M = "tests.unit.rollout.tool_fns"


class ScriptedEngine:
    """Turn 1: the k-th request of the batch calls `calls[k]`; turn 2: every request answers. Records budgets."""

    def __init__(self, tok, calls):
        self.tok, self.calls, self.turn, self.budgets, self.requests = tok, calls, 0, [], []
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")

    def close(self):
        pass

    def generate(self, prompts, sampling, seeds, max_tokens=None):
        self.turn += 1
        self.budgets.append(list(max_tokens))
        self.requests.append([list(p) for p in prompts])
        out = []
        for k, _ in enumerate(prompts):
            text = self.calls[k] if self.turn == 1 else "done"
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.eot]
            out.append([Generation(k, ids, [-0.25] * len(ids), "stop")])
        return out


def _worker(tok, calls, env=None, tools=("echo", "crash"), dims=None):
    specs = resolve_tools([f"{M}:{t}" for t in tools])
    environment = load_environment(env) if env else None
    runner = ToolRunner(specs, environment.methods if environment else (), workers=1, timeout_s=5.0)
    schemas = [s.schema for s in specs] + (list(environment.schemas) if environment else [])
    suffix = ToolSuffix(tok, FAMILIES["chatml"], schemas)
    loop = ToolLoop(tok, suffix, hermes, runner, TurnLimits(3, 3, 32, 200))
    engine = ScriptedEngine(tok, calls)
    sampler = Sampler(engine, tok, dims or ParallelDims(1, 0, 0, 1), SamplingSettings(200, 1.0, 1.0, -1), seed=0)
    return MultiTurnRollout(sampler, tok, AgentSetup(loop, runner, suffix, environment)), engine


def _records(tok, n, targets=None):
    targets = targets or [2] * n
    return [PromptRecord(i, f"q{i}", tuple(tok(f"question {i}")["input_ids"]), ReadOnlyFields({"target": targets[i]}))
            for i in range(n)]


def _call(name, args):
    import json
    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def test_an_infra_failure_is_dropped_before_group_statistics_and_counted():
    tok = tokenizer_for("qwen2.5")
    calls = [_call("echo", {"text": "a"}), _call("echo", {"text": "b"}), _call("echo", {"text": "c"}),
             _call("crash", {"code": 1})]
    worker, engine = _worker(tok, calls)
    try:
        rollout = worker.generate(_records(tok, 2), n=2, step=1, group_base=10)
    finally:
        worker.close()
    assert [s.uid for s in rollout.held] == [0, 1, 2] and rollout.index.size == 3
    assert rollout.index.groups.tolist() == [10, 10, 11]  # record 1 keeps one sample, its failed one is gone
    m = rollout.metrics
    assert m["rollout/infra_failed_rate"] == 0.25 and m["rollout/tool_call_rate"] == 1.0
    assert m["rollout/tool_calls_mean"] == 1.0 and m["rollout/turns_mean"] == pytest.approx(1.75)
    assert engine.budgets[0] == [200] * 4 and len(engine.budgets[1]) == 3  # turn 2: only the active ones, as ids
    for s in rollout.held:
        assert s.loss_mask.numel() == s.response_len and 0 < int(s.loss_mask.sum()) < s.response_len
        assert s.fields["tool_calls"][0]["status"] == "ok" and s.fields["target"] == 2
        assert bool(s.loss_mask[-1]) and not s.truncated
    # GRPO over the index sees only the survivors: the failed sample cannot drag its group's mean.
    adv = grpo(torch.tensor([1.0, 0.0, 1.0]), rollout.index.groups, torch.ones(3, 1))
    assert adv[0, 0] > 0 > adv[1, 0]


def test_an_environment_gives_the_prompt_the_tools_and_the_reward():
    tok = tokenizer_for("qwen2.5")
    worker, _ = _worker(tok, [_call("increment", {"by": 2}), _call("increment", {"by": 1})], env=f"{M}:Counter",
                        tools=())
    try:  # record 1's target cannot be read: its environments fail to start, an infrastructure failure, not a crash
        rollout = worker.generate(_records(tok, 2, targets=[2, "two"]), n=2, step=1, group_base=0)
    finally:
        worker.close()
    first = rollout.held[0]
    assert "Increment the counter to 2." in tok.decode(first.prompt_ids) and "increment" in tok.decode(first.prompt_ids)
    assert [s.fields["env_reward"] for s in rollout.held] == [1.0, 0.0]
    assert "2" in tok.decode(first.response_ids[~first.loss_mask])
    assert rollout.index.size == 2 and rollout.metrics["rollout/infra_failed_rate"] == 0.5


def test_an_environments_prompt_longer_than_the_engine_allows_fails_its_trajectory_only():
    tok, spec = tokenizer_for("qwen2.5"), load_environment(f"{M}:Counter")
    env, o = open_environment(spec, tok, None, {"target": 2}, [5, 6], max_prompt_tokens=3)
    assert env is None and "over data.max_prompt_tokens=3" in o.error and o.prompt_ids == (5, 6)
    env, o = open_environment(spec, tok, None, {"target": 2}, [5, 6], max_prompt_tokens=500)
    assert env.target == 2 and o.own_prompt and not o.error
    assert "Increment the counter to 2." in tok.decode(o.prompt_ids)


def test_merging_the_groups_answers_takes_each_from_its_one_owner_and_checks_the_ranks_agree():
    assert merge_parts([(7, {0: "a", 2: "c"}), (7, {1: "b"})]) == {0: "a", 1: "b", 2: "c"}
    with pytest.raises(RuntimeError, match="hold different multi-turn trajectories"):
        merge_parts([(7, {0: "a"}), (8, {1: "b"})])
    with pytest.raises(RuntimeError, match=r"trajectories \[1\] were answered by two ranks"):
        merge_parts([(7, {1: "a"}), (7, {1: "b"})])
