"""The data layer: prompt and preference datasets, the resumable loader, packing and length-based batching.

Layer 1: imports torch, pyarrow and the standard library only; a tokenizer object is passed in.
"""

from hybrid_rl.data.batching import balance_across_ranks, balance_units, split_by_token_budget
from hybrid_rl.data.datasets import Tokenizer, load_preference_dataset, load_prompt_dataset
from hybrid_rl.data.loader import PromptLoader
from hybrid_rl.data.packing import PackedBatch, ResponseIndex, pack, pad
from hybrid_rl.data.records import PreferenceDataset, PreferenceRecord, PromptDataset, PromptRecord, ReadOnlyFields
from hybrid_rl.data.rows import DatasetError

__all__ = [
    "DatasetError",
    "PackedBatch",
    "PreferenceDataset",
    "PreferenceRecord",
    "PromptDataset",
    "PromptLoader",
    "PromptRecord",
    "ReadOnlyFields",
    "ResponseIndex",
    "Tokenizer",
    "balance_across_ranks",
    "balance_units",
    "load_preference_dataset",
    "load_prompt_dataset",
    "pack",
    "pad",
    "split_by_token_budget",
]
