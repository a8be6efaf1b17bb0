"""MoE routes travel with their sample to its trainer, compactly (their own integer width), and a sample without
routes arrives without."""

import torch

from hybrid_rl.rollout.exchange import gather_index, send_to_owners
from hybrid_rl.types import Sample


def test_routes_travel_with_the_sample_in_their_own_dtype():
    narrow = torch.randint(0, 8, (6, 2, 2), dtype=torch.uint8)
    wide = torch.randint(0, 300, (3, 2, 4), dtype=torch.int16)
    held = [Sample(0, torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7]), torch.zeros(4), False, 0, 0, {},
                   routes=narrow),
            Sample(1, torch.tensor([1]), torch.tensor([2]), torch.zeros(1), False, 0, 1, {}),
            Sample(2, torch.tensor([9, 9]), torch.tensor([8, 8]), torch.zeros(2), True, 1, 2, {}, routes=wide)]
    assert gather_index(held, 3).size == 3
    got = send_to_owners(held, torch.tensor([0, 0, 0]), 1, lambda i: {})
    assert got[0].routes.dtype == torch.uint8 and torch.equal(got[0].routes, narrow)
    assert got[1].routes.numel() == 0
    assert got[2].routes.dtype == torch.int16 and torch.equal(got[2].routes, wide)
    assert torch.equal(got[2].response_ids, held[2].response_ids) and got[2].truncated
