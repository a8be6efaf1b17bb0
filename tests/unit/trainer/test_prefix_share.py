"""Prefix-shared passes (`trainer.prefix_share`): loss and every gradient equal the unshared passes, float32.

Each case runs the real update (`updates.update_actor` / `update_critic`) and passes (`experience/passes.py`) twice
on copies of one model, shared and unshared, and compares the losses and each parameter's gradient (the optimizer
records them instead of stepping) within 1e-6 relative. Prompts and responses cross MATH_MAX_LEN so that both CPU
attention kernels run in the shared layout.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from hybrid_rl.algos.objectives import ObjectiveSettings, get_objective
from hybrid_rl.experience.passes import logprobs_pass, values_pass
from hybrid_rl.model.attention import MATH_MAX_LEN, register
from hybrid_rl.model.forward import micro_batches
from hybrid_rl.model.handle import Model
from hybrid_rl.types import TrainBatch
from hybrid_rl.updates import UpdateSettings, response_mask, update_actor, update_critic
from tests.unit.trainer.samples import make_sample

VOCAB, REL = 96, 1e-6
GRPO = ObjectiveSettings("seq-mean-token-mean", 0.2, 0.2, None, 0.0, "low_var_kl", 0.0, 0.1, "sigmoid", 0.0)
DAPO_KL = ObjectiveSettings("token-mean", 0.2, 0.28, None, 0.05, "low_var_kl", 0.01, 0.1, "sigmoid", 0.0)


class RecordGrads(torch.optim.Optimizer):
    """Keeps a copy of every gradient at each step instead of stepping (the update then zeroes them)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])


def _config(labels: int | None = None) -> Qwen2Config:
    extra = {} if labels is None else {"num_labels": labels, "classifier_dropout": 0.0}
    return Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       use_sliding_window=False, **extra)


def _models(cls=Qwen2ForCausalLM, **kw):
    torch.manual_seed(0)
    model = cls(_config(**kw)).float()
    model.set_attn_implementation(register())
    return model, copy.deepcopy(model)


def _groups(prompt_lens, response_lens, seed=0, turns: int = 0):
    """Samples of len(prompt_lens) groups, one per prompt, `response_lens[g]` responses each. `turns`: each response
    is a trajectory of that many assistant turns separated by tool results (context, loss mask 0)."""
    g, out = torch.Generator().manual_seed(seed), []
    for gid, (p, lens) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        prompt = torch.randint(3, VOCAB, (p,), generator=g).tolist()
        for n in lens:
            response = torch.randint(3, VOCAB, (n,), generator=g).tolist()
            s = make_sample(len(out), prompt, response, group=gid,
                            logprobs=(-torch.rand(n, generator=g)).tolist())
            if turns:
                mask = torch.ones(n, dtype=torch.bool)
                cut = n // turns
                for t in range(1, turns):  # a tool result of 3 tokens after each turn but the last
                    mask[t * cut: t * cut + 3] = False
                s = type(s)(**{**s.__dict__, "loss_mask": mask})
            out.append(s)
    return out


def _batch(samples, old, ref=None, *, loss_masked=False):
    width = max(s.response_len for s in samples)
    mask = response_mask(samples, width)
    if loss_masked:
        for i, s in enumerate(samples):
            mask[i, : s.response_len] &= s.loss_mask
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(len(samples), generator=g)
    adv = (rewards[:, None] - rewards.mean()) * mask  # one advantage per sample, as GRPO's
    rollout = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        rollout[i, : s.response_len] = s.rollout_logprobs
    return TrainBatch(samples, mask, rewards, old, adv, ref, rollout_logp=rollout)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _assert_same_grads(a: RecordGrads, b: RecordGrads):
    assert len(a.grads) == len(b.grads) > 0
    for step_a, step_b in zip(a.grads, b.grads, strict=True):
        for ga, gb in zip(step_a, step_b, strict=True):
            assert _rel(ga, gb) <= REL, _rel(ga, gb)


def _actor_case(samples, settings: ObjectiveSettings, *, budget: int, loss_masked=False, with_ref=False):
    unshared, shared = _models()
    results = []
    for module, share in ((unshared, False), (shared, True)):
        old = logprobs_pass(module, samples, temperature=0.9, budget=budget, share=share)
        ref = logprobs_pass(module, samples, temperature=0.9, budget=budget, share=share) * 0.9 if with_ref else None
        opt = RecordGrads(module.parameters())
        u = UpdateSettings(1, 1, budget=budget, temperature=0.9, grad_clip=0.0, horizon=64, world=1,
                           prefix_share=share)
        stats, ok, _ = update_actor(Model(module, opt), _batch(samples, old, ref, loss_masked=loss_masked),
                                    get_objective("ppo_clip"), settings, u)
        assert ok
        results.append((old, ref, stats, opt))
    (old_a, ref_a, stats_a, opt_a), (old_b, ref_b, stats_b, opt_b) = results
    assert _rel(old_b, old_a) <= REL
    if with_ref:
        assert _rel(ref_b, ref_a) <= REL
    for key in ("actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm"):
        if key in stats_a:
            assert stats_b[key] == pytest.approx(stats_a[key], rel=REL, abs=1e-9), key
    _assert_same_grads(opt_a, opt_b)
    assert "actor/prefix_saved_frac" not in stats_a
    return stats_b


LONG = MATH_MAX_LEN + 20  # a prompt run by the fused CPU kernel


def test_grpo_update_equals_unshared():
    samples = _groups([9, 5, LONG], [[4, 7, 1, 6], [3, 3], [5, 2, 8]])
    assert any(mb.tree is not None for mb in micro_batches(samples, 512, share=True))
    stats = _actor_case(samples, GRPO, budget=512)
    saved = 3 * 9 + 1 * 5 + 2 * LONG  # (n - 1) prompts per group
    assert stats["actor/prefix_saved_frac"] == pytest.approx(saved / sum(s.length for s in samples))


def test_dapo_with_kl_reference_pass_equals_unshared():
    _actor_case(_groups([11, 6], [[5, 9, 2, 4, 6, 1, 3, 7], [2, 4]], seed=1), DAPO_KL, budget=512, with_ref=True)


def test_three_turn_trajectories_share_only_their_prompt():
    samples = _groups([12, 7], [[21, 15, 30], [18, 24]], seed=2, turns=3)
    _actor_case(samples, DAPO_KL, budget=512, loss_masked=True, with_ref=True)


def test_ppo_critic_values_and_update_equal_unshared():
    samples = _groups([8, LONG], [[3, 6, 2], [4, 5]], seed=3)
    unshared, shared = _models(Qwen2ForTokenClassification, labels=1)
    out = []
    for module, share in ((unshared, False), (shared, True)):
        values = values_pass(module, samples, budget=512, share=share)
        batch = _batch(samples, None)
        batch = TrainBatch(batch.samples, batch.mask, batch.scores, batch.old_logp, batch.advantages,
                           values=values, returns=values + batch.advantages + 0.1 * batch.mask)
        opt = RecordGrads(module.parameters())
        u = UpdateSettings(1, 1, budget=512, temperature=1.0, grad_clip=0.0, horizon=64, world=1, prefix_share=share)
        stats, ok = update_critic(Model(module, opt), batch, value_clip=0.2, loss_agg="token-mean", u=u)
        assert ok
        out.append((values, stats, opt))
    (va, sa, oa), (vb, sb, ob) = out
    assert _rel(vb, va) <= REL
    assert sb["critic/value_loss"] == pytest.approx(sa["critic/value_loss"], rel=REL)
    _assert_same_grads(oa, ob)


def test_a_group_over_the_budget_falls_back_to_unshared_packing_and_still_matches():
    samples = _groups([20, 6], [[30, 25, 28], [4, 5]], seed=4)  # group 0 shared: 103 tokens > 64
    mbs = micro_batches(samples, 64, share=True)
    trees = [mb.tree for mb in mbs if mb.tree is not None]
    assert trees and all(p == 6 for t in trees for p, b in t.segments if len(b) > 1)  # only group 1 is shared
    assert all(mb.num_tokens <= 64 for mb in (m.packed for m in mbs))
    _actor_case(samples, GRPO, budget=64)


def test_shared_micro_batches_count_each_prompt_once():
    samples = _groups([40, 40], [[4] * 8, [4] * 8], seed=5)
    shared = micro_batches(samples, 4096, share=True)
    plain = micro_batches(samples, 4096)
    assert sum(mb.packed.num_tokens for mb in shared) == 2 * 40 + 16 * 4
    assert sum(mb.packed.num_tokens for mb in plain) == 16 * 44
