"""The typed records and datasets the data layer hands to the rest of the framework.

Records are frozen: a record is shared between the sampler, the rollout dumps and the reward functions, and
none of them may change what the others see.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload


class ReadOnlyFields(Mapping[str, Any]):
    """A row's extra columns (`ground_truth`, `tests`, ...), exactly as read, behind a read-only mapping.

    Not `types.MappingProxyType`: that cannot be pickled or deep-copied, and records travel to other processes
    (dataloader workers, object broadcasts). Values are not deep-frozen, so that they keep the types the file
    gave them (lists stay lists); do not mutate them.
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"ReadOnlyFields({self._data!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self._data

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._data = state


@dataclass(frozen=True)
class PromptRecord:
    """One prompt for rollout.

    Attributes:
        index: the row's position in the concatenated source files, counted before over-long rows are dropped;
            a stable id for logs and rollout dumps (it is not the position in the dataset).
        prompt_text: exactly the text that was tokenized (the chat template already applied, where it was).
        prompt_ids: its token ids.
        fields: every other column of the row, untouched (reward inputs such as `ground_truth` or `tests`).
    """

    index: int
    prompt_text: str
    prompt_ids: tuple[int, ...]
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class PreferenceRecord:
    """One DPO pair: a prompt and two responses, each response ending with the tokenizer's eos id.

    `index` has the same meaning as in `PromptRecord`.
    """

    index: int
    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]


@dataclass(frozen=True)
class PromptDataset(Sequence[PromptRecord]):
    """The prompts that fit `max_prompt_tokens`, in file order, plus how many rows were dropped for length."""

    records: tuple[PromptRecord, ...]
    num_dropped_too_long: int
    max_prompt_tokens: int

    @overload
    def __getitem__(self, i: int) -> PromptRecord: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[PromptRecord, ...]: ...
    def __getitem__(self, i: int | slice) -> PromptRecord | tuple[PromptRecord, ...]:
        return self.records[i]

    def __len__(self) -> int:
        return len(self.records)


@dataclass(frozen=True)
class PreferenceDataset(Sequence[PreferenceRecord]):
    """The pairs whose prompt and both responses fit their limits, plus how many pairs were dropped for length."""

    records: tuple[PreferenceRecord, ...]
    num_dropped_too_long: int
    max_prompt_tokens: int
    max_response_tokens: int

    @overload
    def __getitem__(self, i: int) -> PreferenceRecord: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[PreferenceRecord, ...]: ...
    def __getitem__(self, i: int | slice) -> PreferenceRecord | tuple[PreferenceRecord, ...]:
        return self.records[i]

    def __len__(self) -> int:
        return len(self.records)
