"""The colocated multi-turn rollout worker on a scripted engine: trajectories become samples with their loss masks
and fields, an infrastructure failure is dropped before group statistics (the rest renumbered), metrics add up; at
TP 2 (two gloo processes) each trajectory's tools and environment run on one rank of the group and both ranks send
the engine the same requests."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid_rl.algos.advantages import grpo
from hybrid_rl.colocated.multi_turn import MultiTurnRollout
from hybrid_rl.colocated.sampler import Sampler
from hybrid_rl.data.records import PromptRecord, ReadOnlyFields
from hybrid_rl.distributed.mesh import ParallelDims, free_port
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


# At TP 2 (one DP group of two ranks) both ranks play all 6 trajectories: 3 records x n=2, uid u held by rank u % 2.
# Record 2's environments cannot start (its target is not a number); uid 1's tool service is down.
TP_CALLS = [_call("increment", {"by": 2}), _call("unavailable", {"service": "db"}), _call("increment", {"by": 1}),
            _call("increment", {"by": 2}) + _call("echo", {"text": "hello"})]


def _tp_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        tok = tokenizer_for("qwen2.5")
        worker, engine = _worker(tok, TP_CALLS, env=f"{M}:Counter", tools=("echo", "unavailable"),
                                 dims=ParallelDims(2, rank, rank, 2))
        try:
            rollout = worker.generate(_records(tok, 3, targets=[2, 2, "two"]), n=2, step=1, group_base=0)
        finally:
            worker.close()
        held = [(s.uid, s.prompt_ids.tolist(), s.response_ids.tolist(), s.loss_mask.tolist(),
                 s.rollout_logprobs.tolist(), s.fields.get("env_reward"), [c["status"] for c in s.fields["tool_calls"]])
                for s in rollout.held]
        torch.save({"held": held, "requests": engine.requests, "size": rollout.index.size,
                    "metrics": rollout.metrics}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_at_tp_2_each_trajectorys_tools_run_on_one_rank_and_both_ranks_send_the_same_requests(tmp_path):
    mp.spawn(_tp_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    # vLLM's external launcher needs this: every turn, the same contexts from both ranks of the group
    assert r0["requests"] == r1["requests"] and len(r0["requests"]) == 2 and len(r0["requests"][0]) == 4
    tok = tokenizer_for("qwen2.5")
    assert all("Increment the counter to 2." in tok.decode(p) for p in r0["requests"][0])  # the owners' resets
    # uid 1 (its tool's service down) and uids 4, 5 (no environment) are dropped on both ranks; survivors 0, 2, 3 -> 0, 1, 2,
    # each held by the rank that ran its tools (rank 0: old uids 0 and 2; rank 1: old uid 3)
    assert r0["size"] == r1["size"] == 3 and r0["metrics"] == r1["metrics"]
    assert r0["metrics"]["rollout/infra_failed_rate"] == pytest.approx(0.5)
    assert [h[0] for h in r0["held"]] == [0, 1] and [h[0] for h in r1["held"]] == [2]
    # each environment's state is where its methods ran: its owner's reward reads the calls it answered
    assert [h[5] for h in r0["held"]] == [1.0, 0.0] and r1["held"][0][5] == 1.0
    assert r1["held"][0][6] == ["ok", "ok"]  # increment (the environment's) and echo (a worker's), once each
    # the ids trained are what the engine saw: each held trajectory's turn-2 request is its prompt and response up
    # to its last model turn; the log-probs are the engine's on model tokens, 0 on context
    contexts = {tuple(c) for c in r0["requests"][1]}
    for _, prompt, response, mask, logprobs, _, _ in r0["held"] + r1["held"]:
        second_turn = len(response) - mask[::-1].index(False)  # where the last run of model tokens starts
        assert tuple(prompt + response[:second_turn]) in contexts
        assert all(lp == (-0.25 if m else 0.0) for lp, m in zip(logprobs, mask, strict=True))
    assert "hello" in tok.decode(r1["held"][0][2])
