"""`data/tree.py`: the prefix-shared row's tokens, position ids and the positions each response token is read from."""

import pytest
import torch

from hybrid_rl.data.tree import pack_tree


def test_a_group_is_its_prompt_once_then_each_response_with_positions_continuing_from_the_prompt():
    t = lambda *x: torch.tensor(x)  # noqa: E731
    packed, layout, resp = pack_tree([(t(1, 2, 3), [t(10, 11), t(20), t(30, 31, 32)]), (t(4, 5), [t(40)])])
    assert packed.input_ids[0].tolist() == [1, 2, 3, 10, 11, 20, 30, 31, 32, 4, 5, 40]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 3, 4, 5, 0, 1, 2]
    assert layout.segments == ((3, (2, 1, 3)), (2, (1,)))
    assert packed.seq_lens == (9, 3) and packed.cu_seqlens.tolist() == [0, 9, 12]
    assert resp.target_positions.tolist() == [3, 4, 5, 6, 7, 8, 11]
    # every response's first token is read from its prompt's last position (2, and 10 in the second group)
    assert resp.logit_positions.tolist() == [2, 3, 2, 2, 6, 7, 10]
    assert resp.sequence_ids.tolist() == [0, 0, 1, 2, 2, 2, 3] and resp.response_lens == (2, 1, 3, 1)


def test_an_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty"):
        pack_tree([(torch.zeros(0, dtype=torch.int64), [torch.tensor([1])])])
