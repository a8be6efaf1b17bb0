"""TP slicing rules, checked by hand on small shapes."""

import pytest

from hybrid_rl.weightsync.layout import Layout, ModelDims


def dims(**kw):
    base = dict(architecture="Qwen2ForCausalLM", vocab_size=462, hidden_size=128, intermediate_size=256,
                num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=False)
    return ModelDims(**{**base, **kw})


def test_column_row_and_replicated_slices():
    lay = Layout(dims(), tp=2)
    q = lay.slice("model.layers.0.self_attn.q_proj.weight", (128, 128), 1)
    assert (q.dim, q.start, q.stop, q.vllm_name, q.dest_offset) == (0, 64, 128, "model.layers.0.self_attn.qkv_proj.weight", 0)
    k = lay.slice("model.layers.0.self_attn.k_proj.weight", (64, 128), 1)
    assert (k.start, k.stop, k.dest_offset) == (32, 64, 64)  # after the 64 local q rows
    v = lay.slice("model.layers.0.self_attn.v_proj.bias", (64,), 0)
    assert (v.start, v.stop, v.dest_offset) == (0, 32, 96)
    o = lay.slice("model.layers.3.self_attn.o_proj.weight", (128, 128), 1)
    assert (o.dim, o.start, o.stop, o.shape) == (1, 64, 128, (128, 64))
    up = lay.slice("model.layers.0.mlp.up_proj.weight", (256, 128), 0)
    assert (up.start, up.stop, up.dest_offset, up.module) == (0, 128, 128, "model.layers.0.mlp.gate_up_proj")
    norm = lay.slice("model.norm.weight", (128,), 1)
    assert norm.dim is None and norm.shape == (128,)


def test_vocab_is_padded_to_64_before_splitting():
    lay = Layout(dims(), tp=2)  # 462 -> 512 padded -> 256 per rank
    first = lay.slice("model.embed_tokens.weight", (462, 128), 0)
    assert (first.dim, first.start, first.stop) == (0, 0, 256)
    last = lay.slice("lm_head.weight", (462, 128), 1)
    assert (last.start, last.stop, last.shape) == (256, 462, (206, 128))


def test_kv_heads_are_replicated_when_fewer_than_tp_ranks():
    lay = Layout(dims(num_kv_heads=1), tp=2)
    for t in (0, 1):  # both ranks hold the single KV head
        k = lay.slice("model.layers.0.self_attn.k_proj.weight", (32, 128), t)
        assert (k.start, k.stop, k.dest_offset) == (0, 32, 64)


def test_tied_lm_head_is_not_sent():
    assert Layout(dims(tie_word_embeddings=True), 1).skip("lm_head.weight")
    assert not Layout(dims(), 1).skip("lm_head.weight")


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        Layout(dims(architecture="GPT2LMHeadModel"), 1)


def test_tp_that_does_not_divide_heads_is_rejected():
    with pytest.raises(ValueError, match="num_attention_heads"):
        Layout(dims(num_heads=6, head_dim=32, num_kv_heads=6), 4)
