"""The sibling drafter's matching on hand-built batches (`rollout.speculative=siblings`; in vLLM, greedy tokens with
and without it: tests/engine/test_speculative.py)."""

from types import SimpleNamespace

import numpy as np
import pytest

from hybrid_rl.rollout import sibling_drafter
from hybrid_rl.rollout.sibling_drafter import draft, prompt_groups

P, Q = [1, 2, 3], [9, 8, 7]  # two prompts
WIDTH = 16


def batch(rows: list[tuple[list[int], list[int]]]):
    """vLLM's input batch as the drafter sees it: (prompt, response so far) per row, padded with zeros."""
    tokens = np.zeros((len(rows), WIDTH), dtype=np.int32)
    for i, (prompt, response) in enumerate(rows):
        tokens[i, :len(prompt) + len(response)] = prompt + response
    num_tokens = np.array([len(p) + len(r) for p, r in rows], dtype=np.int32)
    num_prompt = np.array([len(p) for p, _ in rows], dtype=np.int32)
    return tokens, num_tokens, num_prompt


def drafts(rows, k=3, min_n=2, max_n=3, max_len=WIDTH, active=None) -> list[list[int] | None]:
    """Each row's draft (None: not asked for)."""
    tokens, num_tokens, num_prompt = batch(rows)
    which = list(range(len(rows))) if active is None else active
    out, lens = draft(tokens, num_tokens, num_prompt, prompt_groups(tokens, num_prompt, len(rows)),
                      np.array(which, dtype=np.int64), min_n, max_n, k, max_len)
    got: list[list[int] | None] = [None] * len(rows)
    for pos, i in enumerate(which):
        got[i] = out[pos, :lens[pos]].tolist()
    return got


def test_a_request_drafts_what_followed_its_last_tokens_in_a_sibling_ahead_of_it_and_ignores_other_prompts():
    got = drafts([(Q, [5, 10, 11, 20, 21, 22]),   # another prompt's response matches row 1's end over 3 tokens,
                  (P, [5, 10, 11]),               # this one's own context has no match,
                  (P, [6, 10, 11, 12, 13, 14])])  # its sibling's matches over 2 and goes on
    assert got[1] == [12, 13, 14]
    # Row 2's end (13, 14) is nowhere before; row 0's (21, 22) neither: no draft.
    assert got[0] == [] and got[2] == []


def test_its_own_context_wins_a_tie_and_a_longer_sibling_match_wins_over_it():
    own = [40, 41, 50, 40, 41]  # (40, 41) was followed by 50 in its own context
    assert drafts([(P, own), (P, [70, 40, 41, 60, 61])])[0] == [50, 40, 41]
    # Its own context matches (40, 41), the sibling (30, 40, 41): the sibling's continuation; not another prompt's.
    own = [42, 40, 41, 50, 30, 40, 41]
    assert drafts([(P, own), (P, [30, 40, 41, 60, 61])])[0] == [60, 61]
    assert drafts([(P, own), (Q, [30, 40, 41, 60, 61])])[0] == [50, 30, 40]


def test_a_sibling_in_lockstep_adds_nothing_and_a_match_may_start_in_the_prompt():
    same = [20, 21, 22]
    assert drafts([(P, same), (P, same)]) == [[], []]  # what one has the other has: nothing follows
    assert drafts([(P, [2, 3])])[0] == [2, 3]  # its own prompt is context: (2, 3) followed (1, 2, 3)
    # (2, 3, 50) across the prompt's end in the sibling; the sibling's end (51, 52) is nowhere before.
    assert drafts([(P, [50]), (P, [50, 51, 52])]) == [[51, 52], []]


def test_a_draft_stops_at_the_end_of_the_source_at_k_and_at_the_model_length_and_only_active_rows_draft():
    rows = [(P, [4, 5]), (P, [4, 5, 6, 7, 8, 9, 10])]
    assert drafts(rows, k=8)[0] == [6, 7, 8, 9, 10]
    assert drafts(rows, k=2)[0] == [6, 7]
    assert drafts(rows, k=8, max_len=len(P) + 2 + 1)[0] == [6]
    assert drafts(rows, active=[1]) == [None, []]  # row 0 not asked for (its token was discarded): untouched


def test_rows_in_passes_draft_what_one_pass_drafts():
    rng = np.random.default_rng(0)
    rows = [([1, 2] if i % 3 else [7], rng.integers(3, 6, size=rng.integers(1, 12)).tolist()) for i in range(10)]
    tokens, num_tokens, num_prompt = batch(rows)
    group, asked = prompt_groups(tokens, num_prompt, 10), np.array([0, 2, 3, 5, 6, 9])
    one = draft(tokens, num_tokens, num_prompt, group, asked, 1, 3, 4, WIDTH)
    assert one[1].sum() > 0
    for chunk in (1, 20, 70):
        passes = draft(tokens, num_tokens, num_prompt, group, asked, 1, 3, 4, WIDTH, chunk=chunk)
        assert np.array_equal(one[0], passes[0]) and np.array_equal(one[1], passes[1])


def test_groups_are_identical_prompt_tokens():
    tokens, _, num_prompt = batch([(P, [4]), (Q, [4]), (P, [5, 6]), (P[:2], [3])])
    assert prompt_groups(tokens, num_prompt, 4).tolist() == [0, 1, 0, 2]  # (1, 2) + response 3 is another prompt


class GPUModelRunner:
    """Stands for vLLM's runner where the drafter looks for it: the constructor that builds the drafter, and the
    input batch's prompt lengths (the drafter's use of vLLM for real: tests/engine/test_speculative.py)."""

    def __init__(self, config, rows):
        self.input_batch = SimpleNamespace(num_prompt_tokens=batch(rows)[2])
        self.drafter = sibling_drafter.SiblingDrafter_1_2(config)


def test_the_class_path_carries_the_window_and_propose_drafts_rows_with_a_sampled_token():
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=2),
                             model_config=SimpleNamespace(max_model_len=WIDTH),
                             scheduler_config=SimpleNamespace(max_num_seqs=4))
    rows = [(P, [5, 6]), (P, [5, 6, 7, 8]), (Q, [5])]
    runner = GPUModelRunner(config, rows)  # the drafter holds it weakly, as vLLM's runner holds the drafter
    d = runner.drafter
    assert (d.ngram_min, d.ngram_max, d.k) == (1, 2, 2)
    tokens, num_tokens, _ = batch(rows)
    assert d.propose([[6], [8], []], num_tokens, tokens) == [[7, 8], [], []]
    with pytest.raises(RuntimeError, match="must be built by vLLM's model runner"):
        sibling_drafter.SiblingDrafter_2_4(config)
    with pytest.raises(AttributeError, match="no attribute 'SiblingDrafter_x'"):
        sibling_drafter.__getattr__("SiblingDrafter_x")
