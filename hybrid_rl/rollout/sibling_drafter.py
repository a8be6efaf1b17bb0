"""`rollout.speculative=siblings`: a drafter that also reads the group's sibling responses, loaded by vLLM by import
path (`speculative_config={"method": "custom_class", "model": "<this module>.SiblingDrafter_<min>_<max>"}`).

The `rollout.n` responses of a prompt are requests with the same prompt tokens, generated side by side; they often
share phrases, and one is often ahead of another (it started later, or took a shorter path to the same step). For
each request the drafter looks for its last `min`..`max` tokens, as vLLM's `ngram` does, in its own context and in
the responses of the batch's requests whose prompt is identical to its own (its siblings), and proposes the tokens
that followed the longest match (its own context on a tie). Two siblings in lockstep add nothing over `ngram`: what
one has generated the other has too; a sibling ahead hands over what it already wrote.

vLLM 0.32 calls a custom proposer as `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)` (the runner's
`propose_draft_token_ids`, `method == "custom_class"`): every row's tokens but not where its prompt ends. The prompt
lengths are the runner's input batch's (`num_prompt_tokens`); vLLM builds the drafter inside the runner's
constructor and passes it nothing but the config, so the drafter finds the runner on the stack there (and refuses
to start if it is not there). vLLM reads the class path only, and overwrites a custom proposer's
`prompt_lookup_min/max` with 0, so the window travels in the class name (`SiblingDrafter_2_4`).

The matching is compiled (numba, as vLLM's `ngram` is): one pass over the request's context and its siblings'
responses per request and step, where most positions are rejected at their first token.
"""

from __future__ import annotations

import re
import sys
import weakref

import numpy as np
from numba import njit

NAME = re.compile(r"SiblingDrafter_(\d+)_(\d+)")


@njit(cache=False)
def _longest_before(tokens, j, lo, hi, i, n_i, max_n, best, best_row, best_end):
    """The earliest end `e` in [lo, hi) of row `j` whose preceding tokens match the last tokens of row `i` (its first
    `n_i`) over more than `best` tokens, up to `max_n`: (length, row, end), or the best so far."""
    for e in range(lo, hi):
        m = 0
        while m < max_n and m < e and m < n_i and tokens[j, e - 1 - m] == tokens[i, n_i - 1 - m]:
            m += 1
        if m > best:
            best, best_row, best_end = m, j, e
            if m == max_n:
                break
    return best, best_row, best_end


@njit(cache=False)
def draft(tokens, num_tokens, num_prompt, group, rows, min_n, max_n, k, max_len, out, out_len):
    """Drafts for `rows` into `out[row, :out_len[row]]`. `tokens[r, :num_tokens[r]]`: row r's prompt and response so
    far, its first `num_prompt[r]` its prompt; `group[r]`: rows with the same value have the same prompt."""
    num_rows = group.shape[0]
    for r in range(rows.shape[0]):
        i = rows[r]
        n_i = num_tokens[i]
        out_len[i] = 0
        kk = min(k, max_len - n_i)
        if kk <= 0 or n_i < min_n:
            continue
        # Its own context first (a match ends before the last token: something follows it) ...
        best, row, end = _longest_before(tokens, i, 1, n_i, i, n_i, max_n, 0, -1, -1)
        # ... then its siblings' responses: a match must be followed by a token the sibling generated.
        for j in range(num_rows):
            if best == max_n:
                break
            if j != i and group[j] == group[i]:
                best, row, end = _longest_before(tokens, j, max(num_prompt[j], 1), num_tokens[j], i, n_i, max_n,
                                                 best, row, end)
        if best >= min_n:
            take = min(kk, num_tokens[row] - end)
            out[i, :take] = tokens[row, end:end + take]
            out_len[i] = take


def prompt_groups(tokens: np.ndarray, num_prompt: np.ndarray, num_rows: int) -> np.ndarray:
    """One id per row, the same for rows whose prompt tokens are identical (the exact bytes are the key)."""
    ids: dict[bytes, int] = {}
    return np.array([ids.setdefault(tokens[i, :num_prompt[i]].tobytes(), len(ids)) for i in range(num_rows)],
                    dtype=np.int64)


def _building_runner():
    """The vLLM model runner whose constructor is building the drafter (an instance of a `GPUModelRunner` class,
    which the CPU runner is too), found up the stack; RuntimeError when there is none."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if any(c.__name__ == "GPUModelRunner" for c in type(obj).__mro__):
            return obj
        frame = frame.f_back
    raise RuntimeError("rollout.speculative=siblings: the drafter must be built by vLLM's model runner (vLLM 0.32's "
                       "`custom_class` proposer): it reads the runner's input batch for where each prompt ends")


class SiblingDrafter:
    """vLLM's custom proposer: drafts from each request's own context and its siblings' responses."""

    ngram_min = 2  # the window matched (a subclass named by the class path sets it: `SiblingDrafter_<min>_<max>`)
    ngram_max = 4

    def __init__(self, vllm_config) -> None:
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_len = vllm_config.model_config.max_model_len
        self._runner = weakref.ref(_building_runner())  # the runner holds the drafter: no cycle through it
        rows = vllm_config.scheduler_config.max_num_seqs
        self._out = np.zeros((rows, self.k), dtype=np.int32)
        self._len = np.zeros(rows, dtype=np.int32)
        one = np.zeros((1, 4), dtype=np.int32)  # compile now, not at the first step
        draft(one, np.ones(1, np.int32), np.ones(1, np.int32), np.zeros(1, np.int64), np.zeros(1, np.int64),
              self.ngram_min, self.ngram_max, self.k, self.max_len, self._out, self._len)

    def load_model(self, *args, **kwargs) -> None:
        """No model (vLLM's CPU runner calls it on every drafter)."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None) -> list[list[int]]:
        num_rows = len(sampled_token_ids)
        # A row whose token was discarded (a prompt still being computed) or that is full gets no draft, as in ngram.
        rows = np.array([i for i, s in enumerate(sampled_token_ids) if s and num_tokens_no_spec[i] < self.max_len],
                        dtype=np.int64)
        self._len[:num_rows] = 0
        if len(rows):
            num_prompt = self._runner().input_batch.num_prompt_tokens
            draft(token_ids_cpu, num_tokens_no_spec, num_prompt, prompt_groups(token_ids_cpu, num_prompt, num_rows),
                  rows, self.ngram_min, self.ngram_max, self.k, self.max_len, self._out, self._len)
        return [self._out[i, :self._len[i]].tolist() for i in range(num_rows)]


def __getattr__(name: str) -> type[SiblingDrafter]:
    """`SiblingDrafter_<min>_<max>`: the drafter matching windows of `min`..`max` tokens (vLLM resolves the class
    path with getattr on this module)."""
    m = NAME.fullmatch(name)
    if m is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return type(name, (SiblingDrafter,), {"ngram_min": int(m[1]), "ngram_max": int(m[2]), "__module__": __name__})
