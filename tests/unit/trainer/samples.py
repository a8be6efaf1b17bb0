"""Random token samples for update tests (no model or tokenizer needed to make them)."""

import torch

from hybrid_rl.types import Sample


def make_sample(uid: int, prompt: list[int], response: list[int], *, group: int | None = None,
                logprobs: list[float] | None = None) -> Sample:
    lp = torch.zeros(0) if logprobs is None else torch.tensor(logprobs, dtype=torch.float32)
    return Sample(uid, torch.tensor(prompt, dtype=torch.int64), torch.tensor(response, dtype=torch.int64), lp, False,
                  uid if group is None else group, uid, {})


def random_samples(n: int, seed: int = 0, *, max_response: int = 6) -> list[Sample]:
    """`n` samples of 3-8 prompt and 1-`max_response` response tokens, two per group."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(5, 400, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(5, 400, (int(torch.randint(1, max_response + 1, (1,), generator=g)),), generator=g).tolist()
        out.append(make_sample(i, p, r, group=i // 2))
    return out
