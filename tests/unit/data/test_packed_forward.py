"""A Hugging Face causal LM on packed input gives the same per-token logits as each sequence run alone.

This pins the transformers behaviour the packing design relies on (5.19): with `position_ids` restarting at 0
and no attention mask, sdpa and eager attention keep each sequence to itself, but ONLY with `use_cache=False`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hybrid_rl.data import pack, pad

_SHAPE = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
)
_ARCHS = {
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_SHAPE, use_sliding_window=False)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_SHAPE, head_dim=32)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_SHAPE)),
}
# Lengths 1 and 2 are the edge cases: a one-token sequence right after another one.
LENGTHS = (5, 1, 9, 1, 3)


def _model(arch: str, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = _ARCHS[arch]().float().eval()
    model.set_attn_implementation(attn)
    return model


def _sequences() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, _SHAPE["vocab_size"], (n,), generator=generator) for n in LENGTHS]


@torch.no_grad()
def _alone(model, sequences) -> torch.Tensor:
    return torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in sequences])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@torch.no_grad()
def test_packed_logits_match_each_sequence_run_alone(arch, attn):
    model, sequences = _model(arch, attn), _sequences()
    batch = pack(sequences)
    packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0]
    torch.testing.assert_close(packed, _alone(model, sequences), rtol=0, atol=1e-5)


@torch.no_grad()
def test_padded_logits_match_each_sequence_run_alone_on_real_tokens():
    model, sequences = _model("qwen2", "sdpa"), _sequences()
    input_ids, attention_mask, position_ids = pad(sequences, pad_id=0)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits
    torch.testing.assert_close(logits[attention_mask.bool()], _alone(model, sequences), rtol=0, atol=1e-5)


@torch.no_grad()
def test_packed_input_leaks_across_sequences_when_the_kv_cache_is_on():
    # The trap: the config default use_cache=True builds a cache, which turns off packed-sequence detection.
    model, sequences = _model("qwen2", "sdpa"), _sequences()
    model.train()  # train mode does not turn the cache off either
    batch = pack(sequences)
    leaky = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits[0]
    first = LENGTHS[0]
    alone = _alone(model, sequences)
    torch.testing.assert_close(leaky[:first], alone[:first], rtol=0, atol=1e-5)  # the first sequence sees no other
    assert (leaky[first:] - alone[first:]).abs().max() > 1e-2
