"""Rollout correction in `update_actor`: `none` changes nothing, bit for bit; both sources of the old
log-probs (a separate pass, or the update's own forward) get the same correction. And the step's
mismatch metrics, by hand."""

import copy
import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_rl.algos.correction import CorrectionSettings
from hybrid_rl.algos.objectives import ObjectiveSettings, get_objective
from hybrid_rl.experience.batch import mismatch_metrics, sampler_logprobs
from hybrid_rl.experience.passes import logprobs_pass
from hybrid_rl.model.handle import Model
from hybrid_rl.types import TrainBatch
from hybrid_rl.updates import UpdateSettings, response_mask, update_actor
from tests.unit.trainer.samples import make_sample, random_samples

TODAY = ObjectiveSettings("token-mean", 0.2, 0.2, None, 0.1, "low_var_kl", 0.01, 0.1, "sigmoid", 0.0)


def _with(correction: CorrectionSettings | None) -> ObjectiveSettings:
    return dataclasses.replace(TODAY, correction=correction)


@pytest.fixture(scope="module")
def setup(tiny_models):
    """A tiny model, 8 samples, their pre-update log-probs, and sampler log-probs that differ from them."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    samples = random_samples(8, seed=1)
    old = logprobs_pass(model, samples, temperature=1.0, budget=24)
    g = torch.Generator().manual_seed(3)
    mask = response_mask(samples, old.shape[1])
    rollout = torch.where(mask, old + 0.8 * torch.randn(old.shape, generator=g), 0)
    ref = old + 0.05 * torch.randn(old.shape, generator=g)
    adv = torch.randn(old.shape, generator=g) * mask
    return model, samples, old, rollout, ref, adv, mask


def _update(setup, settings: ObjectiveSettings, *, separate_pass: bool, with_rollout: bool = True):
    model, samples, old, rollout, ref, adv, mask = setup
    module = copy.deepcopy(model)
    batch = TrainBatch(samples, mask, torch.zeros(len(samples)), old if separate_pass else None, adv, ref,
                       rollout_logp=rollout if with_rollout else None)
    u = UpdateSettings(1, 1, budget=24, temperature=1.0, grad_clip=0.0, horizon=8, world=1)
    stats, ok, _ = update_actor(Model(module, torch.optim.SGD(module.parameters(), lr=0.5)), batch,
                                get_objective("ppo_clip"), settings, u)
    assert ok
    return stats, list(module.parameters())


@pytest.mark.parametrize("separate_pass", [True, False], ids=["old_logp_pass", "old_logp_from_update"])
def test_none_is_bitwise_the_update_without_a_correction(setup, separate_pass):
    stats_today, today = _update(setup, TODAY, separate_pass=separate_pass, with_rollout=False)
    none = CorrectionSettings("none", "sequence", 0.9, 1.1)  # thresholds that would bite, were they used
    stats_none, with_none = _update(setup, _with(none), separate_pass=separate_pass)
    assert stats_none == stats_today
    assert all(torch.equal(a, b) for a, b in zip(today, with_none, strict=True))
    # ... while a correction does change the update of the same batch (the test could fail).
    _, with_tis = _update(setup, _with(CorrectionSettings("tis", "token", 0.5, 1.2)), separate_pass=separate_pass)
    assert not all(torch.equal(a, b) for a, b in zip(today, with_tis, strict=True))


@pytest.mark.parametrize("correction", [CorrectionSettings("tis", "token", 0.5, 1.2),
                                        CorrectionSettings("mis", "sequence", 0.2, 5.0)], ids=["tis", "mis"])
def test_both_sources_of_old_logprobs_get_the_same_correction(setup, correction):
    stats_a, a = _update(setup, _with(correction), separate_pass=True)
    stats_b, b = _update(setup, _with(correction), separate_pass=False)
    _, uncorrected = _update(setup, TODAY, separate_pass=True)
    assert stats_b["actor/pg_loss"] == pytest.approx(stats_a["actor/pg_loss"], rel=1e-4, abs=1e-6)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert max(float((x - y).detach().abs().max()) for x, y in zip(a, uncorrected, strict=True)) > 1e-4


def test_mismatch_metrics_by_hand():
    # Sample 0: old (-1, -2, -0.5), sampler (-1, -3, -0.1): log rho (0, 1, -0.4). Sample 1: old -1, sampler -2:
    # log rho 1. Four tokens; the padding of sample 1 holds garbage that must not be read.
    samples = [make_sample(0, [1, 2], [5, 6, 7], logprobs=[-1.0, -3.0, -0.1]),
               make_sample(1, [1, 2], [5], logprobs=[-2.0])]
    mask = response_mask(samples, 3)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, float("nan"), 7.0]])
    batch = TrainBatch(samples, mask, torch.zeros(2), old, torch.zeros(2, 3), rollout_logp=sampler_logprobs(samples, 3))
    m = mismatch_metrics(batch, old, CorrectionSettings("tis", "token", 0.5, 2.0))
    e, e04 = math.e, math.exp(-0.4)
    assert m == pytest.approx({
        "rollout/logprob_diff_mean": (0 + 1 + 0.4 + 1) / 4, "rollout/logprob_diff_max": 1.0,
        "rollout_correction/is_ratio_mean": (1 + e + e04 + e) / 4,  # 1.776721
        "rollout_correction/is_ratio_max": e,
        "rollout_correction/truncated_frac": 2 / 4,  # the two ratios of e > 2
        "rollout_correction/masked_frac": 0.0,
        "rollout_correction/kl_k1": (0 - 1 + 0.4 - 1) / 4,  # mean(rollout - old) = -0.4
        "rollout_correction/kl_k3": (0 + (e - 2) + (e04 - 0.6) + (e - 2)) / 4,  # mean(rho - 1 - log rho) = 0.376721
    }, rel=1e-5)
    # Sequence level, mis in [0.5, 2]: sample 0's ratio e^(0 + 1 - 0.4) = 1.822 is kept, sample 1's (e) masked.
    m = mismatch_metrics(batch, old, CorrectionSettings("mis", "sequence", 0.5, 2.0))
    assert m["rollout_correction/is_ratio_mean"] == pytest.approx((3 * math.exp(0.6) + e) / 4, rel=1e-5)
    assert m["rollout_correction/masked_frac"] == 1 / 4 and m["rollout_correction/truncated_frac"] == 0.0
