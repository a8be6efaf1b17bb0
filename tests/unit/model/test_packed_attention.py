"""`model/attention.py`'s packed SDPA: logits and gradients of a packed row equal each sequence run alone.

Sequences on both sides of MATH_MAX_LEN, so both kernels run (the math kernel for short ones on CPU, the fused one
for long ones), and one-token sequences next to others.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybrid_rl.data import pack
from hybrid_rl.model.attention import MATH_MAX_LEN, _backends, register

LENGTHS = (5, 1, MATH_MAX_LEN, MATH_MAX_LEN + 40, 1, 30)


def _model(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         use_sliding_window=False)
    model = Qwen2ForCausalLM(config).float()
    model.set_attn_implementation(attn)
    return model


def test_short_sequences_use_the_math_kernel_on_cpu_only():
    assert _backends(torch.device("cpu"), MATH_MAX_LEN) == [SDPBackend.MATH]
    assert SDPBackend.FLASH_ATTENTION in _backends(torch.device("cpu"), MATH_MAX_LEN + 1)
    assert SDPBackend.FLASH_ATTENTION in _backends(torch.device("meta"), 8)


def test_packed_logits_and_gradients_equal_each_sequence_alone():
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 64, (n,), generator=g) for n in LENGTHS]
    weights = torch.randn(sum(LENGTHS), 64, generator=g)

    packed_model = _model(register())
    batch = pack(sequences)
    packed = packed_model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0]
    (packed * weights).sum().backward()

    alone_model = _model("sdpa")
    alone = torch.cat([alone_model(input_ids=s[None], use_cache=False).logits[0] for s in sequences])
    (alone * weights).sum().backward()

    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    for (name, p), q in zip(packed_model.named_parameters(), alone_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
