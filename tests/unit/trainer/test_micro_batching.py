"""The update's gradient does not depend on how a mini-batch is cut into micro-batches (with and without
rollout correction: its weights depend only on each row's own tokens, its denominators are the mini-batch's), for
every policy-gradient objective (GSPO's sequence ratio is a row's mean, and a row is always a whole sample)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_rl.algos.correction import CorrectionInputs, CorrectionSettings, rollout_correction
from hybrid_rl.algos.objectives import MicroInputs, ObjectiveSettings, get_objective
from hybrid_rl.model.forward import micro_batches, policy_logprobs
from hybrid_rl.types import TrainBatch
from hybrid_rl.updates import denominators, response_mask, rows
from tests.unit.trainer.samples import random_samples

CORRECTIONS = [None, CorrectionSettings("tis", "token", 0.5, 1.5), CorrectionSettings("mis", "sequence", 0.3, 3.0)]


def _grads(model, batch: TrainBatch, budget: int, agg: str, correction=None,
           objective="ppo_clip") -> list[torch.Tensor]:
    model.zero_grad()
    s = ObjectiveSettings(agg, 0.2, 0.2, None, 0.1, "k3", 0.01, 0.1, "sigmoid", 0.0, correction)
    d = denominators(batch, horizon=8)
    mbs = micro_batches(batch.samples, budget)
    for mb in mbs:
        logp, ent = policy_logprobs(model, mb, temperature=1.0, with_entropy=True)
        w = logp.shape[1]
        x = MicroInputs(logp, ent, rows(batch.mask, mb, w, "cpu"), rows(batch.old_logp, mb, w, "cpu"),
                        rows(batch.advantages, mb, w, "cpu"), rows(batch.ref_logp, mb, w, "cpu"), None,
                        rows(batch.rollout_logp, mb, w, "cpu"))
        loss, _ = get_objective(objective).loss(x, s, d)
        loss.backward()
    return len(mbs), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("correction", CORRECTIONS, ids=["none", "tis_token", "mis_sequence"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batch_of_one_and_of_four_give_equal_gradients(tiny_models, agg, correction, objective):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    samples = random_samples(8)
    width = max(s.response_len for s in samples)
    mask = response_mask(samples, width)
    with torch.no_grad():
        old = torch.randn(8, width) * 0.1 - 3.0
        adv = torch.randn(8, width) * mask
        rollout = old + torch.randn(8, width) * 0.7  # some tokens (and sequences) outside the thresholds
        batch = TrainBatch(samples, mask, torch.zeros(8), old, adv, old + 0.05, rollout_logp=rollout)
    if correction is not None:
        c = rollout_correction(CorrectionInputs(old, rollout, mask), correction)
        assert 0 < int((c.truncated | c.masked).sum()) < int(mask.sum())  # the correction has work to do
    n1, g1 = _grads(model, batch, budget=1, agg=agg, correction=correction, objective=objective)  # each alone
    n4, g4 = _grads(model, batch, budget=4 * 16, agg=agg, correction=correction, objective=objective)  # ~4 each
    assert n1 == 8 and 1 < n4 < 8
    for a, b in zip(g1, g4, strict=True):  # summation order differs: float32 rounding, relative to the scale
        torch.testing.assert_close(a, b, rtol=1e-5, atol=max(1e-7, 1e-5 * float(a.abs().max())))
