"""Chunked log-probs and entropies equal (and differentiate like) a plain float64 log-softmax."""

import pytest
import torch

from hybrid_rl.model.logprobs import logits_to_logprobs


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    x = logits.double() / temperature
    logp = torch.log_softmax(x, -1)
    return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [3, 1024])
@pytest.mark.parametrize("use", ["logp", "entropy", "both"])
def test_values_and_gradients_match_a_plain_log_softmax(temperature, chunk, use):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(10, 37, generator=g)).requires_grad_()
    targets = torch.randint(0, 37, (10,), generator=g)
    w_lp, w_ent = torch.randn(10, generator=g), torch.randn(10, generator=g)
    lp, ent = logits_to_logprobs(logits, targets, temperature=temperature, chunk=chunk, with_entropy=True)
    ref_lp, ref_ent = _reference(logits, targets, temperature)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-5)
    pick = {"logp": lambda a, b: (a * w_lp).sum(), "entropy": lambda a, b: (b * w_ent).sum(),
            "both": lambda a, b: (a * w_lp).sum() + (b * w_ent).sum()}[use]
    (got,) = torch.autograd.grad(pick(lp, ent), logits)
    (want,) = torch.autograd.grad(pick(ref_lp, ref_ent), logits)
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk", [3, 1024])
def test_without_entropy_the_log_probs_and_their_gradient_are_those_computed_with_it(chunk):
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(10, 37, generator=g)).requires_grad_()
    targets = torch.randint(0, 37, (10,), generator=g)
    w = torch.randn(10, generator=g)
    lp_only = logits_to_logprobs(logits, targets, temperature=0.7, chunk=chunk)
    lp, _ = logits_to_logprobs(logits, targets, temperature=0.7, chunk=chunk, with_entropy=True)
    assert torch.equal(lp_only, lp)
    (got,) = torch.autograd.grad((lp_only * w).sum(), logits)
    (want,) = torch.autograd.grad((lp * w).sum(), logits)
    assert torch.equal(got, want)


def test_bf16_logits_get_a_bf16_gradient_and_no_float32_copy_is_kept():
    logits = torch.randn(6, 50, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 50, (6,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lp = logits_to_logprobs(logits, targets, chunk=4)
    assert lp.dtype == torch.float32
    assert [t.dtype for t in saved if t.dim() == 2] == [torch.bfloat16]  # only the logits, in their own dtype
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_no_positions_give_empty_outputs_and_a_zero_gradient():
    logits = torch.randn(0, 11, requires_grad=True)
    lp, ent = logits_to_logprobs(logits, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.shape == (0, 11)


def test_the_in_place_logsumexp_is_torchs_including_rows_of_infinities():
    from hybrid_rl.model.logprobs import _logsumexp_

    x = 3 * torch.randn(5, 300, generator=torch.Generator().manual_seed(2))
    x[1] = float("-inf")  # every entry masked
    x[2, 7] = float("inf")
    x[3, :150] = float("-inf")
    want = torch.logsumexp(x, -1)
    got = _logsumexp_(x.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert got[1] == float("-inf") and got[2] == float("inf")
