"""GSPO's sequence ratio is each row's mean log-ratio, so a row must hold a whole sequence. The trainer's
micro-batches are cut between samples (never through one) and scatter each sample's response to a row of its own:
so the per-row mean is exact, and GSPO's loss and gradient are the same packed or padded, in one micro-batch or
in several (the several-micro-batch case, with rollout correction, is in test_micro_batching.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_rl.algos import gspo_loss
from hybrid_rl.algos.objectives import MicroInputs, ObjectiveSettings, get_objective
from hybrid_rl.model.forward import micro_batches, policy_logprobs
from hybrid_rl.types import TrainBatch
from hybrid_rl.updates import denominators, response_mask, rows
from tests.unit.trainer.samples import random_samples

SETTINGS = ObjectiveSettings("seq-mean-token-mean", 0.2, 0.2, None, 0.0, "k3", 0.0, 0.1, "sigmoid", 0.0)


@pytest.mark.parametrize("budget", [1, 7, 12, 20, 33, 1000])
def test_micro_batches_never_split_a_sample(budget):
    # Budgets below, between and above the samples' lengths (5 to 14 tokens): each sample lands whole in one
    # micro-batch, and its response tokens fill exactly its own row, from offset 0.
    samples = random_samples(9, seed=3)
    units = [[0, 1], [2], [3, 4], [5], [6, 7], [8]]  # pairs stay together too
    seen = []
    for mb in micro_batches(samples, budget, units=units):
        seen += mb.indices
        ones, mask = mb.response.scatter(torch.ones(len(mb.response.target_positions)))
        for row, i in enumerate(mb.indices):
            assert int(mask[row].sum()) == samples[i].response_len == int(ones[row].sum())
            assert bool(mask[row, : samples[i].response_len].all())
        for u in units:
            assert set(u) <= set(mb.indices) or not set(u) & set(mb.indices)
    assert sorted(seen) == list(range(9))


def _batch(samples) -> TrainBatch:
    g = torch.Generator().manual_seed(4)
    width = max(s.response_len for s in samples)
    mask = response_mask(samples, width)
    old = torch.randn(len(samples), width, generator=g) * 0.1 - 3.0
    adv = torch.randn(len(samples), 1, generator=g).expand(-1, width) * mask  # one advantage per sequence
    return TrainBatch(samples, mask, torch.zeros(len(samples)), old, adv, None)


def _packed(model, batch: TrainBatch, budget: int):
    """Loss and gradients of GSPO through the trainer's path: packed micro-batches, global denominators."""
    model.zero_grad()
    d, total, n = denominators(batch, horizon=8), 0.0, 0
    for mb in micro_batches(batch.samples, budget):
        logp = policy_logprobs(model, mb, temperature=1.0)
        w = logp.shape[1]
        x = MicroInputs(logp, None, rows(batch.mask, mb, w, "cpu"), rows(batch.old_logp, mb, w, "cpu"),
                        rows(batch.advantages, mb, w, "cpu"), None, None)
        loss, _ = get_objective("gspo").loss(x, SETTINGS, d)
        loss.backward()
        total, n = total + float(loss.detach()), n + 1
    return n, total, [p.grad.clone() for p in model.parameters()]


def _padded(model, batch: TrainBatch):
    """The same loss from an ordinary right-padded batch forward (attention mask, no packing), by `gspo_loss`."""
    model.zero_grad()
    seqs = [torch.cat([s.prompt_ids, s.response_ids]) for s in batch.samples]
    length = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.int64)
    attn = torch.zeros(len(seqs), length, dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], attn[i, : len(s)] = s, 1
    logits = model(input_ids=ids, attention_mask=attn).logits.float().log_softmax(-1)
    width = batch.mask.shape[1]
    logp = torch.zeros(len(seqs), width)
    for i, s in enumerate(batch.samples):
        p, r = s.prompt_len, s.response_len
        logp[i, :r] = logits[i, p - 1 : p + r - 1].gather(-1, s.response_ids[:, None])[:, 0]
    loss, _ = gspo_loss(logp, batch.old_logp, batch.advantages, batch.mask, 0.2, 0.2)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def test_gspo_packed_and_padded_one_and_several_micro_batches_agree(tiny_models):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32, attn_implementation="eager")
    batch = _batch(random_samples(8, seed=5))
    n_all, loss_all, g_all = _packed(model, batch, budget=10_000)  # every sample in one pack
    n_one, loss_one, g_one = _packed(model, batch, budget=1)  # every sample alone
    n_few, loss_few, g_few = _packed(model, batch, budget=30)  # a few per pack
    loss_pad, g_pad = _padded(model, batch)
    assert (n_all, n_one) == (1, 8) and 1 < n_few < 8
    for loss in (loss_one, loss_few, loss_pad):
        assert loss == pytest.approx(loss_all, rel=1e-5, abs=1e-7)
    for grads in (g_one, g_few, g_pad):
        for a, b in zip(g_all, grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=max(1e-7, 1e-5 * float(a.abs().max())))


def test_cutting_a_sequence_into_two_rows_would_change_gspo():
    # Why the rows must be whole: the same tokens, one row vs cut in two, give other sequence ratios.
    logp = torch.tensor([[0.6, 0.4, -0.2, -0.4]])
    old, adv = torch.zeros(1, 4), torch.ones(1, 4)
    whole, _ = gspo_loss(logp, old, adv, torch.ones(1, 4), 0.2, 0.2, "token-mean")
    cut, _ = gspo_loss(logp.view(2, 2), old.view(2, 2), adv.view(2, 2), torch.ones(2, 2), 0.2, 0.2, "token-mean")
    # whole: s = e^0.1 on all four tokens. Cut: rows e^0.5 (clipped to 1.2) and e^-0.3.
    assert float(whole) == pytest.approx(-torch.tensor(0.1).exp().item())
    assert float(cut) == pytest.approx((-1.2 - torch.tensor(-0.3).exp().item()) / 2)
