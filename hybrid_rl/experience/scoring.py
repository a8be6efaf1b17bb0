"""Scoring: each rank scores the samples it holds, in its reward worker processes; then all ranks share the scores.

`submit` decodes the held responses and hands them to the pool without waiting; the model passes
run meanwhile. `Pending.result()` waits, then assembles the `[N]` scores of the whole batch on every
rank with one all-reduce of disjoint rows (a few floats per sample, never tokens).
"""

from __future__ import annotations

import logging

import torch

from hybrid_rl.distributed.collectives import all_reduce, all_reduce_max, all_reduce_sum
from hybrid_rl.rewards import RewardPool
from hybrid_rl.types import Sample, Scores

log = logging.getLogger(__name__)


class Pending:
    """Scores on their way: `result()` is collective (every rank calls it once)."""

    def __init__(self, handle, uids: list[int], size: int):
        self.handle, self.uids, self.size = handle, uids, size
        self._scores: Scores | None = None

    def result(self) -> Scores:
        if self._scores is None:
            self._scores = self._collect()
        return self._scores

    def _collect(self) -> Scores:
        if self.handle is None:
            return Scores(torch.zeros(self.size))
        res = self.handle.result()
        for f in res.failures[:3]:
            log.warning("reward %s %s on sample %d: %s", f.name, f.kind, self.uids[f.index], f.message)
        names = list(res.by_name)
        rows = torch.zeros(self.size, 1 + len(names), dtype=torch.float64)
        if self.uids:
            uids = torch.tensor(self.uids)
            rows[uids, 0] = torch.tensor(res.totals, dtype=torch.float64)
            for k, name in enumerate(names):
                rows[uids, 1 + k] = torch.tensor(res.by_name[name], dtype=torch.float64)
        rows = all_reduce(rows).float()  # the ranks' rows are disjoint: the sum assembles the batch
        errors, timeouts = all_reduce_sum([res.num_errors, res.num_timeouts])
        seconds = all_reduce_max([res.elapsed_s])[0]
        return Scores(rows[:, 0], {nm: rows[:, 1 + k] for k, nm in enumerate(names)}, int(errors), int(timeouts),
                      seconds)


class Scorer:
    """Scores held samples with the rule rewards (`pool`; None: every score is 0)."""

    def __init__(self, pool: RewardPool | None, tokenizer):
        self.pool, self.tokenizer = pool, tokenizer

    @property
    def part_names(self) -> list[str]:
        """The reward functions' names (`Scores.parts`), in the rubric's order."""
        return [] if self.pool is None else self.pool.rubric.names

    def start(self, held: list[Sample]):
        """Start scoring `held` on this rank: the pool's handle (None without rule rewards). Local."""
        if self.pool is None:
            return None
        # Never batch_decode([]): transformers 5 returns [''] for an empty batch, one text for no sample (a rank of
        # a TP group that holds none of the validation samples).
        ids = [s.response_ids.tolist() for s in held]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True) if ids else []
        return self.pool.submit(texts, [s.fields for s in held])

    def submit(self, held: list[Sample], size: int) -> Pending:
        """Start scoring `held` (samples of a batch of `size`); returns at once."""
        return Pending(self.start(held), [s.uid for s in held], size)

    def score(self, held: list[Sample], size: int) -> Scores:
        return self.submit(held, size).result()


class Ready:
    """Scores already known (scored before the share, or none to score): `result()` returns them."""

    def __init__(self, scores: Scores):
        self.scores = scores

    def result(self) -> Scores:
        return self.scores
