"""Random token samples for update tests (no model or tokenizer needed to make them)."""

import torch

from hybrid_rl.types import Sample


def random_samples(n: int, seed: int = 0) -> list[Sample]:
    """`n` samples of 3-8 prompt and 1-6 response tokens, two per group."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(5, 400, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(5, 400, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(tuple(p), tuple(r), (), False, i // 2, i, {}, ""))
    return out
