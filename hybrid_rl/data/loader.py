"""A deterministic, resumable batch sampler over an in-memory dataset.

The order is a pure function of (seed, epoch, position): epoch `e` is `randperm(len(dataset))` drawn from a
generator seeded with `seed + e`, read in consecutive slices of `batch_size`. So the checkpoint holds two
integers, and a resumed run replays exactly the batches the uninterrupted run would have seen.

The loader is an endless iterator (`next(loader)` per training step, epochs roll over on their own), since
RL training is counted in steps, not epochs. Every rank that builds it with the same arguments gets the same
batches; splitting a batch across data-parallel ranks is the caller's job (see `batching.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch

R = TypeVar("R")


class PromptLoader(Generic[R]):
    """Yield lists of `batch_size` records (the last, shorter one too if `drop_last=False`), forever.

    Args:
        dataset: the records (a `PromptDataset`, a `PreferenceDataset` or any sequence).
        batch_size: records per batch.
        seed: base seed; epoch `e` is shuffled with `seed + e`.
        shuffle: `False` keeps file order in every epoch.
        drop_last: skip an epoch's last partial batch (its records come back, reshuffled, next epoch).
    """

    def __init__(
        self, dataset: Sequence[R], batch_size: int, *, seed: int, shuffle: bool = True, drop_last: bool = True
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) == 0 or (drop_last and len(dataset) < batch_size):
            raise ValueError(
                f"the dataset has {len(dataset)} records, fewer than one batch of {batch_size} with drop_last="
                f"{drop_last}; lower batch_size, add data, or raise the length limits that dropped rows"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._epoch = 0
        self._position = 0  # records of this epoch's order already yielded
        self._order: list[int] | None = None  # this epoch's order, built lazily

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based); it increments right after an epoch's last batch."""
        return self._epoch

    @property
    def num_batches_per_epoch(self) -> int:
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[R]]:
        return self

    def __next__(self) -> list[R]:
        order = self._epoch_order()
        end = min(self._position + self.batch_size, len(order))
        batch = [self.dataset[i] for i in order[self._position : end]]
        self._position = end
        if self._position + (self.batch_size if self.drop_last else 1) > len(order):
            self._epoch += 1
            self._position = 0
            self._order = None
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands, plus what the order depends on (checked on load)."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_records": len(self.dataset),
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state`; refuse a state saved with another seed, batch size, dataset size or order."""
        mine = self.state_dict()
        changed = [k for k in ("seed", "batch_size", "num_records", "shuffle", "drop_last") if state[k] != mine[k]]
        if changed:
            diffs = ", ".join(f"{k}: saved {state[k]!r}, now {mine[k]!r}" for k in changed)
            raise ValueError(f"cannot resume the loader, its order would differ ({diffs}); restore the same settings")
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._order = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self._epoch)
                self._order = torch.randperm(len(self.dataset), generator=generator).tolist()
            else:
                self._order = list(range(len(self.dataset)))
        return self._order
