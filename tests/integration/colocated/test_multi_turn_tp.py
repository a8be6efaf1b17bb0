"""The colocated multi-turn rollout worker at TP 2 (two gloo processes, on the scripted engine of
tests/unit/colocated/test_multi_turn_rollout.py): each trajectory's tools and environment run on one rank of the
group and both ranks send the engine the same requests."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid_rl.distributed.mesh import ParallelDims, free_port
from tests.unit.colocated.test_multi_turn_rollout import M, _call, _records, _worker
from tests.unit.rollout.templates import tokenizer_for

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
