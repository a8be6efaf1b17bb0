"""The update's hot loop: the packed forward gets the sequence boundaries, and no micro-batch reads the device.

On CUDA every `.item()`, `.cpu()`, `.tolist()` or `float(tensor)` waits for the GPU. Counted here with spies
on those methods around `update_actor` (outside the model's own forward, whose attention kernels are the
model's business: given `cu_seq_lens_*` / `max_length_*`, transformers' flash-attention path needs none):
the count must not grow with the number of micro-batches.
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_rl.algos.objectives import ObjectiveSettings, get_objective
from hybrid_rl.model.forward import micro_batches, policy_logprobs
from hybrid_rl.model.handle import Model
from hybrid_rl.types import TrainBatch
from hybrid_rl.updates import UpdateSettings, response_mask, update_actor
from tests.unit.trainer.samples import random_samples

SETTINGS = ObjectiveSettings("token-mean", 0.2, 0.2, None, 0.1, "low_var_kl", 0.01, 0.1, "sigmoid", 0.0)
SYNCS = ("item", "cpu", "tolist", "__float__", "__int__", "__bool__")


class Spy:
    """Counts host reads of tensors (outside the model's forward) and records the model's forward kwargs."""

    def __init__(self, monkeypatch, model: torch.nn.Module):
        self.count, self.inside, self.forwards = 0, False, []
        for name in SYNCS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(original))
        forward = model.forward

        def spied(*args, **kwargs):
            self.forwards.append(kwargs)
            self.inside = True
            try:
                return forward(*args, **kwargs)
            finally:
                self.inside = False

        monkeypatch.setattr(model, "forward", spied)

    def _counting(self, original):
        def counted(t, *args, **kwargs):
            if not self.inside:
                self.count += 1
            return original(t, *args, **kwargs)
        return counted


def _batch(samples, width: int, with_old: bool) -> TrainBatch:
    g = torch.Generator().manual_seed(2)
    mask = response_mask(samples, width)
    adv = torch.randn(mask.shape, generator=g) * mask
    ref = torch.randn(mask.shape, generator=g) * 0.1 - 2
    old = ref + 0.01 if with_old else None
    return TrainBatch(samples, mask, torch.zeros(len(samples)), old, adv, ref)


def _syncs(monkeypatch, module, samples, budget: int, with_old: bool) -> tuple[int, int, list[dict]]:
    """(host reads, micro-batches) of one update of `samples` cut by `budget` tokens."""
    width = max(s.response_len for s in samples)
    batch = _batch(samples, width, with_old)
    mbs = len(micro_batches(samples, budget))
    model = Model(module, torch.optim.AdamW(module.parameters(), lr=1e-3))
    u = UpdateSettings(1, 1, budget=budget, temperature=1.0, grad_clip=1.0, horizon=8, world=1)
    with monkeypatch.context() as m:
        spy = Spy(m, module)
        _, ok, _ = update_actor(model, batch, get_objective("ppo_clip"), SETTINGS, u)
    assert ok
    return spy.count, mbs, spy.forwards


@pytest.mark.parametrize("with_old", [True, False])  # old log-probs from a pass, or from the update itself
def test_host_reads_do_not_grow_with_the_micro_batches(tiny_models, monkeypatch, with_old):
    base = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    samples = random_samples(12, seed=4)
    few, n_few, _ = _syncs(monkeypatch, copy.deepcopy(base), samples, budget=10_000, with_old=with_old)
    many, n_many, forwards = _syncs(monkeypatch, copy.deepcopy(base), samples, budget=16, with_old=with_old)
    assert n_few == 1 and n_many >= 6 and len(forwards) == n_many
    assert many == few, f"{many - few} host reads more with {n_many} micro-batches than with {n_few}"


def test_the_packed_forward_gets_the_sequence_boundaries(tiny_models, monkeypatch):
    module = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    samples = random_samples(5, seed=7)
    spy = Spy(monkeypatch, module)
    mb = micro_batches(samples, 10_000)[0]
    policy_logprobs(module, mb, temperature=1.0)
    (kw,) = spy.forwards
    assert kw["cu_seq_lens_q"] is mb.packed.cu_seqlens and kw["cu_seq_lens_k"] is mb.packed.cu_seqlens
    assert kw["cu_seq_lens_q"].dtype == torch.int32 and kw["cu_seq_lens_q"].tolist()[-1] == mb.packed.input_ids.shape[1]
    assert kw["max_length_q"] == kw["max_length_k"] == mb.packed.max_seqlen == max(mb.packed.seq_lens)
    assert isinstance(kw["max_length_q"], int)  # a Python int: flash-attn reads it without a device sync


def test_packed_sdpa_reads_no_device_tensor_per_layer(tmp_path, monkeypatch):
    """Without flash-attn every layer runs the packed SDPA (`model/attention.py`): given the sequence lengths as
    Python ints by the forward, it reads no device tensor, so a deeper model costs no more host reads."""
    from hybrid_rl.model.attention import register
    from hybrid_rl.model.tiny import TinySpec, build_tiny_model

    reads = []
    for layers in (2, 6):
        folder = build_tiny_model(tmp_path / f"l{layers}", TinySpec(layers=layers))
        module = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=register())
        mb = micro_batches(random_samples(6, seed=3), 10_000)[0]
        assert len(mb.packed.seq_lens) == 6
        with monkeypatch.context() as m:
            spy = Spy(m, torch.nn.Module())  # counts every read: none is inside a spied forward
            policy_logprobs(module, mb, temperature=1.0)
        reads.append(spy.count)
    assert reads[0] == reads[1], f"host reads grew with the layers: {reads}"
