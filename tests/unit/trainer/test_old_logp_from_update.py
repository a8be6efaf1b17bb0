"""With one optimizer step per batch, the update's own forward pass stands in for the old-log-prob pass."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_rl.algos.objectives import ObjectiveSettings, get_objective
from hybrid_rl.experience.passes import logprobs_pass
from hybrid_rl.model.handle import Model
from hybrid_rl.types import TrainBatch
from hybrid_rl.updates import UpdateSettings, response_mask, update_actor
from tests.unit.trainer.samples import random_samples

SETTINGS = ObjectiveSettings("token-mean", 0.2, 0.2, None, 0.1, "low_var_kl", 0.01, 0.1, "sigmoid", 0.0)


def _update(module, batch: TrainBatch, epochs: int = 1):
    model = Model(module, torch.optim.SGD(module.parameters(), lr=0.5))
    u = UpdateSettings(epochs, 1, budget=24, temperature=1.0, grad_clip=0.0, horizon=8, world=1)
    return update_actor(model, batch, get_objective("ppo_clip"), SETTINGS, u)


def _batch(samples, old, ref) -> TrainBatch:
    mask = response_mask(samples, ref.shape[1])
    adv = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2)) * mask
    return TrainBatch(samples, mask, torch.zeros(len(samples)), old, adv, ref)


def test_update_without_old_logprobs_matches_a_separate_pass_and_fills_them_in(tiny_models):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    separate, reused = base, copy.deepcopy(base)
    samples = random_samples(8, seed=1)
    old = logprobs_pass(separate, samples, temperature=1.0, budget=24)
    ref = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
    with_pass, from_update = _batch(samples, old, ref), _batch(samples, None, ref)

    stats_a, ok_a, _ = _update(separate, with_pass)
    stats_b, ok_b, seen = _update(reused, from_update)

    assert ok_a and ok_b
    torch.testing.assert_close(seen * from_update.mask, old * with_pass.mask, rtol=0, atol=1e-5)
    for key in ("actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm"):
        assert stats_b[key] == pytest.approx(stats_a[key], rel=1e-4, abs=1e-6), key
    assert stats_b["actor/clip_frac"] == 0.0  # ratio exactly 1: nothing to clip
    for a, b in zip(separate.parameters(), reused.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_update_refuses_to_take_old_logprobs_from_itself_over_several_steps(tiny_models):
    module = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    samples = random_samples(2, seed=1)
    ref = torch.zeros(2, max(s.response_len for s in samples))
    with pytest.raises(ValueError, match="one optimizer step"):
        _update(module, _batch(samples, None, ref), epochs=2)
