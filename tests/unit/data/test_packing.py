"""pack / pad / unpack round trips, and the one-token shift between response tokens and the logits predicting them."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.data import pack, pad

SEQUENCES = [[5, 6, 7], [8], [9, 10]]


def test_pack_lays_sequences_end_to_end_with_positions_restarting_at_zero():
    batch = pack(SEQUENCES)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6] and batch.cu_seqlens.dtype == torch.int32
    assert batch.input_ids.dtype == batch.position_ids.dtype == torch.int64
    assert (batch.max_seqlen, batch.seq_lens, batch.num_sequences, batch.num_tokens) == (3, (3, 1, 2), 3, 6)


def test_pack_accepts_tensors_of_any_int_dtype():
    batch = pack([torch.tensor(s, dtype=torch.int32) for s in SEQUENCES])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]] and batch.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert batch.input_ids.dtype == torch.int64


def test_empty_input_and_empty_sequences_are_refused():
    with pytest.raises(ValueError, match="no sequences"):
        pack([])
    with pytest.raises(ValueError, match=r"sequences \[1\] are empty"):
        pack([[1], []])


def test_pad_right_pads_with_a_mask_and_positions_over_real_tokens():
    input_ids, attention_mask, position_ids = pad(SEQUENCES, pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert attention_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert position_ids.tolist() == [[0, 1, 2], [0, 0, 0], [0, 1, 0]]


def test_unpack_of_packed_values_equals_the_padded_layout():
    batch = pack(SEQUENCES)
    padded_ids, attention_mask, _ = pad(SEQUENCES, pad_id=-1)

    values, mask = batch.unpack(batch.input_ids[0], pad_value=-1)
    assert values.tolist() == padded_ids.tolist()
    assert mask.tolist() == attention_mask.bool().tolist()

    per_token_vectors = batch.input_ids[..., None].float().expand(1, 6, 4)  # [1, N, V] as logits come out
    values, _ = batch.unpack(per_token_vectors)
    assert values.shape == (3, 3, 4)
    assert values[2, 1].tolist() == [10.0] * 4


def test_response_index_points_at_response_tokens_and_one_position_before_them():
    # Sequence 0: prompt [1, 2], response [3, 4, 5]; sequence 1: prompt [6], response [7].
    batch = pack([[1, 2, 3, 4, 5], [6, 7]])
    index = batch.response_index(prompt_lens=[2, 1], response_lens=[3, 1])
    assert index.target_positions.tolist() == [2, 3, 4, 6]
    assert batch.input_ids[0, index.target_positions].tolist() == [3, 4, 5, 7]
    assert index.logit_positions.tolist() == [1, 2, 3, 5]  # each is the token just before, in the same sequence


def test_log_probs_read_through_the_index_match_each_sequence_run_alone():
    torch.manual_seed(0)
    prompts, responses = [[1, 2], [3], [4, 5, 6]], [[7, 8, 9], [10, 11], [12]]
    sequences = [p + r for p, r in zip(prompts, responses, strict=True)]
    batch = pack(sequences)
    logits = torch.randn(1, batch.num_tokens, 16)  # stands in for model(**packed).logits

    index = batch.response_index([len(p) for p in prompts], [len(r) for r in responses])
    flat = logits[0, index.logit_positions].log_softmax(-1)
    flat = flat.gather(-1, batch.input_ids[0, index.target_positions, None])[:, 0]
    per_sequence, mask = index.scatter(flat)

    for s, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        start = int(batch.cu_seqlens[s])
        alone = logits[0, start : start + len(prompt) + len(response)].log_softmax(-1)
        # The log-prob of token t is predicted at position t - 1.
        expected = [alone[len(prompt) + j - 1, token] for j, token in enumerate(response)]
        assert torch.allclose(per_sequence[s, : len(response)], torch.stack(expected))
        assert mask[s].tolist() == [j < len(response) for j in range(3)]


def test_a_perfect_next_token_predictor_gets_log_prob_zero_on_every_response_token():
    batch = pack([[1, 2, 3, 4], [5, 6, 7]])
    next_tokens = torch.roll(batch.input_ids[0], -1)  # what a perfect model predicts at each position
    logits = torch.nn.functional.one_hot(next_tokens, 8).float()[None] * 100.0
    index = batch.response_index([2, 1], [2, 2])

    log_probs = logits[0, index.logit_positions].log_softmax(-1)
    log_probs = log_probs.gather(-1, batch.input_ids[0, index.target_positions, None])[:, 0]
    assert torch.allclose(log_probs, torch.zeros(4), atol=1e-6)  # an off-by-one would give -100


def test_scatter_pads_per_response_values_and_carries_gradients():
    index = pack([[1, 2, 3, 4, 5], [6, 7], [8, 9]]).response_index([2, 1, 2], [3, 1, 0])
    values = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)

    padded, mask = index.scatter(values, pad_value=-9.0)
    assert padded.tolist() == [[1.0, 2.0, 3.0], [4.0, -9.0, -9.0], [-9.0, -9.0, -9.0]]
    assert mask.tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    (padded * mask).sum().backward()
    assert values.grad.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_response_lengths_that_do_not_add_up_are_refused():
    batch = pack([[1, 2, 3]])
    with pytest.raises(ValueError, match="sequence 0: prompt_len 1 \\+ response_len 1 != its length 3"):
        batch.response_index([1], [1])
    with pytest.raises(ValueError, match="prompt_len >= 1"):
        batch.response_index([0], [3])
