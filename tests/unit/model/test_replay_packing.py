"""Routing replay through the trainer's packed micro-batches (`model.forward`, `experience.passes`): the experts
used are the samples' routes token for token however the samples are packed and cut into micro-batches, the
replayed log-probs and gradients do not depend on that cut nor on activation checkpointing, and the old-log-prob
pass's own routes (R2) replay to agreement 1.0."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.experience.passes import logprobs_pass
from hybrid_rl.model.forward import micro_batches, policy_logprobs, replayed
from hybrid_rl.model.loading import enable_activation_checkpointing, load_causal_lm
from hybrid_rl.model.routing_replay import Replay, record_routes
from hybrid_rl.types import Sample

LENGTHS = ((4, 5), (3, 1), (6, 7), (2, 3))  # (prompt, response) tokens


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from hybrid_rl.model.tiny import TinySpec, build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("moe"), TinySpec(arch="qwen3_moe")))


def _samples(model) -> list[Sample]:
    """Samples whose routes are not the model's own (every expert id moved by one), as a rollout's would be where
    they disagree; the last token of each has none (no rollout forward saw it)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for uid, (p, r) in enumerate(LENGTHS):
        ids = torch.randint(3, 250, (p + r,), generator=g)
        with torch.no_grad(), record_routes(model) as rec:
            model(input_ids=ids[None])
        routes = ((rec.routes().long() + 1) % 8).to(torch.uint8)[:-1]
        out.append(Sample(uid, ids[:p], ids[p:], torch.zeros(r), False, uid, uid, {}, routes=routes))
    return out


def _used_experts(model):
    seen, handles = [], []
    for layer in model.model.layers:
        handles.append(layer.mlp.experts.register_forward_hook(
            lambda _m, args, _out: seen.append(args[1].detach().clone())))
    return seen, handles


def test_the_experts_used_are_the_routes_in_every_packing(path):
    model = load_causal_lm(path)
    samples = _samples(model)
    for budget in (10_000, 12):  # one micro-batch of all samples; one or two samples per micro-batch
        stats = Replay()
        for mb in micro_batches(samples, budget, routes=True):
            seen, handles = _used_experts(model)
            with torch.no_grad(), replayed(model, mb, stats):
                policy_logprobs(model, mb, temperature=1.0)
            for h in handles:
                h.remove()
            for layer, chosen in enumerate(seen):
                given = mb.routes[:, layer].long()
                assert torch.equal(chosen[mb.known], given[mb.known])  # exactly the rollout's, agreement 1.0
            assert int(mb.known.sum()) == sum(s.length - 1 for s in (samples[i] for i in mb.indices))
        assert stats.total == sum(s.length - 1 for s in samples) * 2  # tokens x layers, the last tokens excluded
        assert stats.agreement < 0.05  # measured before the override: the model's own choice differs
        m = stats.metrics()
        assert m["moe/load_balance"] >= 1.0 and 0 < m["moe/router_entropy"] <= torch.log(torch.tensor(8.0))


def test_replayed_logprobs_and_gradients_do_not_depend_on_micro_batching_or_checkpointing(path):
    results = []
    for checkpointing, budget in ((False, 10_000), (False, 12), (True, 12)):
        model = load_causal_lm(path)
        samples = _samples(model)
        if checkpointing:
            enable_activation_checkpointing(model)
        model.train()
        logps = torch.zeros(len(samples), max(s.response_len for s in samples))
        for mb in micro_batches(samples, budget, routes=True):
            with replayed(model, mb, Replay()):
                lp = policy_logprobs(model, mb, temperature=1.0)
                mask = torch.arange(lp.shape[1])[None] < torch.tensor([samples[i].response_len for i in mb.indices])[:, None]
                (lp * mask).sum().neg().backward()
            logps[mb.indices, : lp.shape[1]] = (lp * mask).detach()
        results.append((logps, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    plain = load_causal_lm(path)
    unreplayed = logprobs_pass(plain, _samples(plain), temperature=1.0, budget=10_000)
    assert not torch.allclose(unreplayed, results[0][0], atol=1e-3)  # the replay changes what the model computes
    for logps, grads in results[1:]:
        torch.testing.assert_close(logps, results[0][0], rtol=0, atol=1e-5)
        assert grads.keys() == results[0][1].keys()
        for n in grads:
            torch.testing.assert_close(grads[n], results[0][1][n], rtol=1e-4, atol=1e-5, msg=n)
    assert any("mlp.gate" in n for n in results[0][1])  # the router still learns


def test_the_old_logprob_pass_records_routes_that_replay_exactly(path):
    model = load_causal_lm(path)
    samples = [Sample(s.uid, s.prompt_ids, s.response_ids, s.rollout_logprobs, False, s.group, s.record_index, {})
               for s in _samples(model)]
    record = [None] * len(samples)
    old = logprobs_pass(model, samples, temperature=1.0, budget=12, record=record)
    assert [r.shape[0] for r in record] == [s.length for s in samples] and record[0].dtype == torch.uint8
    replayed_samples = [Sample(s.uid, s.prompt_ids, s.response_ids, s.rollout_logprobs, False, s.group,
                               s.record_index, {}, routes=r) for s, r in zip(samples, record, strict=True)]
    stats = Replay()
    again = logprobs_pass(model, replayed_samples, temperature=1.0, budget=10_000, replay=stats)
    assert stats.agreement == 1.0 and stats.total == sum(s.length for s in samples) * 2
    torch.testing.assert_close(again, old, rtol=0, atol=1e-5)
