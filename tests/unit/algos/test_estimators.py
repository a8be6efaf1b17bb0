"""The product's sharded estimators are the contract's functions (`ADVANTAGES`), on a batch split over ranks."""

import threading

import pytest
import torch
from torch.testing import assert_close

from hybrid_rl.algos import ADVANTAGES
from hybrid_rl.algos.estimators import ESTIMATORS, AdvantageInputs, AdvantageSettings, get_estimator
from hybrid_rl.algos.shaping import token_rewards

SCORES = torch.tensor([1.0, 0.0, 2.0, 5.0, 3.0, 1.0])  # [N]
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0],
                     [1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # [N, T]
VALUES = torch.tensor([[0.5, 0.25, 0.0], [1.0, 0.5, 0.0], [0.25, 0.0, 0.0],
                       [2.0, 1.0, 0.5], [0.0, 0.5, 0.0], [1.0, 1.0, 1.0]])
SETTINGS = AdvantageSettings(gamma=0.5, lam=0.5)
SHARES = (torch.tensor([0, 3, 4]), torch.tensor([1, 2, 5]))  # two ranks' rows, interleaved across the groups


class TwoRankSum:
    """An all-reduce sum between two threads, one per share (what the trainer's all-reduce is between ranks)."""

    def __init__(self) -> None:
        self.barrier, self.parts = threading.Barrier(2), [None, None]

    def for_rank(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t
            self.barrier.wait()
            total = self.parts[0] + self.parts[1]
            self.barrier.wait()  # both have read before either writes its next part
            return total
        return reduce


def _whole_batch_contract(name: str) -> torch.Tensor:
    """What the contract function gives on the whole batch (hand-worked in test_advantages.py)."""
    fn = ADVANTAGES[name]
    if name in ("grpo", "rloo"):
        return fn(SCORES, GROUPS, torch.ones(6, 1)) * MASK
    rewards = token_rewards(SCORES, MASK, None, 0.0)
    if name == "gae":
        return fn(rewards, VALUES, MASK, SETTINGS.gamma, SETTINGS.lam)[0]
    return fn(rewards, MASK, SETTINGS.gamma)[0]


def test_every_contract_estimator_has_a_sharded_adapter_and_no_other():
    assert set(ESTIMATORS) == set(ADVANTAGES) == {"gae", "grpo", "rloo", "reinforce_pp"}
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; known: 'gae', 'grpo'"):
        get_estimator("ppo")


@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "reinforce_pp"])
def test_two_shares_together_give_the_contract_functions_whole_batch_advantages(name):
    """Each rank sees every score but only its rows' tokens; token estimators whiten with the whole batch's moments."""
    reduce, out = TwoRankSum(), [None, None]

    def rank(r: int) -> None:
        rows = SHARES[r]
        x = AdvantageInputs(SCORES, GROUPS, rows, MASK[rows], values=VALUES[rows], reduce=reduce.for_rank(r))
        out[r] = get_estimator(name)(x, SETTINGS)[0]

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    whole = _whole_batch_contract(name)
    for r in (0, 1):
        assert_close(out[r], whole[SHARES[r]])
    # one share whitened alone (no reduce) would not be the whole batch's: the moments do matter for token estimators
    if name in ("gae", "reinforce_pp"):
        alone = AdvantageInputs(SCORES, GROUPS, SHARES[0], MASK[SHARES[0]], values=VALUES[SHARES[0]])
        assert not torch.allclose(get_estimator(name)(alone, SETTINGS)[0], whole[SHARES[0]])


def test_gae_without_the_critics_values_is_refused():
    with pytest.raises(AssertionError, match="critic's values"):
        get_estimator("gae")(AdvantageInputs(SCORES, GROUPS, SHARES[0], MASK[SHARES[0]]), SETTINGS)
