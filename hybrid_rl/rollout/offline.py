"""Offline preference data as a rollout: each record's (chosen, rejected) responses are two samples.

Nothing is generated. Every rank has the records, so the index is computed locally; the samples are
dealt round-robin to be "held", and the share exchange brings each pair to the rank that trains it,
exactly as for generated samples.
"""

from __future__ import annotations

import torch

from hybrid_rl.data import PreferenceRecord
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.types import BatchIndex, Rollout, Sample

_NO_LOGPROBS = torch.zeros(0)


def preference_rollout(records: list[PreferenceRecord], dims: ParallelDims) -> Rollout:
    """Record k gives samples 2k (chosen) and 2k + 1 (rejected), both in group k."""
    held = []
    prompt_lens, response_lens = [], []
    for k, r in enumerate(records):
        prompt = torch.tensor(r.prompt_ids, dtype=torch.int64)
        for j, ids in enumerate((r.chosen_ids, r.rejected_ids)):
            prompt_lens.append(len(r.prompt_ids))
            response_lens.append(len(ids))
            uid = 2 * k + j
            if uid % dims.world == dims.rank:
                held.append(Sample(uid, prompt, torch.tensor(ids, dtype=torch.int64), _NO_LOGPROBS, False, k,
                                   r.index, {}))
    n = 2 * len(records)
    index = BatchIndex(torch.tensor(prompt_lens), torch.tensor(response_lens), torch.arange(n) // 2,
                       torch.zeros(n, dtype=torch.bool))
    return Rollout(held, index)
