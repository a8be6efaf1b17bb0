"""A multi-turn sample's loss mask survives the trip to its trainer and is the mask the update trains on."""

import torch

from hybrid_rl.experience.batch import loss_mask, sampler_logprobs
from hybrid_rl.rollout.exchange import send_to_owners
from hybrid_rl.rollout.trajectory import Trajectory
from hybrid_rl.types import Sample


def test_the_loss_mask_travels_with_the_sample_and_masks_the_context():
    t = Trajectory([1, 2, 3])
    t.add_model([10, 11], [-0.1, -0.2])
    t.add_context([20, 21, 22])
    t.add_model([12], [-0.3])
    multi = t.to_sample(0, 0, 5, {})
    plain = Sample(1, torch.tensor([4]), torch.tensor([30, 31]), torch.tensor([-1.0, -1.0]), False, 1, 6, {})
    got = send_to_owners([multi, plain], torch.tensor([0, 0]), 1, lambda i: {"row": i})
    assert [s.uid for s in got] == [0, 1]
    assert got[0].loss_mask.tolist() == [True, True, False, False, False, True] and got[1].loss_mask.numel() == 0
    assert torch.equal(got[0].response_ids, multi.response_ids) and got[0].fields == {"row": 5}
    mask = loss_mask(got, 6)
    assert mask.tolist() == [[True, True, False, False, False, True], [True, True, False, False, False, False]]
    assert torch.allclose(sampler_logprobs(got, 6)[0], torch.tensor([-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]))
