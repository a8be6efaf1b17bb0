"""Packed passes equal one-sequence-at-a-time passes: reward-model scores, critic values, log-probs."""

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

from hybrid_rl.model.forward import micro_batches, policy_logprobs, sequence_scores, token_values
from hybrid_rl.types import Sample
from tests.unit.trainer.samples import make_sample


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i, (p, r) in enumerate([(5, 3), (9, 1), (4, 6), (7, 0)]):
        ids = torch.randint(5, 400, (p + r,), generator=g).tolist()
        out.append(make_sample(i, ids[:p], ids[p:]))
    return out


def test_reward_model_scores_of_a_packed_batch_equal_separate_scores(tiny_models):
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_models["qwen2"], num_labels=1, dtype=torch.float32)
    samples = _samples()
    (mb,) = micro_batches(samples, 10_000)
    packed = sequence_scores(rm, mb)
    for i, s in zip(mb.indices, packed, strict=True):
        ids = torch.cat([samples[i].prompt_ids, samples[i].response_ids])[None]
        alone = rm(input_ids=ids).logits[0, 0]
        torch.testing.assert_close(s, alone, rtol=1e-5, atol=1e-5)


def test_critic_values_and_logprobs_of_a_packed_batch_equal_separate_passes(tiny_models):
    torch.manual_seed(0)
    critic = AutoModelForTokenClassification.from_pretrained(tiny_models["qwen2"], num_labels=1, dtype=torch.float32)
    lm = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    samples = _samples()
    (mb,) = micro_batches(samples, 10_000)
    values, logp = token_values(critic, mb), policy_logprobs(lm, mb, temperature=0.7)
    for row, i in enumerate(mb.indices):
        s = samples[i]
        ids = torch.cat([s.prompt_ids, s.response_ids])[None]
        p, r = s.prompt_len, s.response_len
        v = critic(input_ids=ids).logits[0, p - 1 : p + r - 1, 0]
        lp = torch.log_softmax(lm(input_ids=ids).logits[0, p - 1 : p + r - 1] / 0.7, -1)
        lp = lp.gather(-1, ids[0, p:, None])[:, 0]
        torch.testing.assert_close(values[row, :r], v, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logp[row, :r], lp, rtol=1e-5, atol=1e-5)
        assert torch.all(values[row, r:] == 0) and torch.all(logp[row, r:] == 0)  # padding past the response
