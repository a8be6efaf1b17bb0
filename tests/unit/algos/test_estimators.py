"""The product's sharded estimators (built from the contract's `ADVANTAGES`) on a batch split over two ranks give
the whole batch's advantages, worked out by hand."""

import math
import threading

import pytest
import torch
from torch.testing import assert_close

from hybrid_rl.algos import ADVANTAGES
from hybrid_rl.algos.estimators import ESTIMATORS, AdvantageInputs, AdvantageSettings, get_estimator

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


def _by_hand(name: str) -> torch.Tensor:
    """The whole batch's advantages `[N, T]`, worked out here without the library.

    Group estimators, per group (0: scores [1, 0, 2], 1: [5, 3, 1]): GRPO (s - mean) / unbiased std = [0, -1, 1] and
    [1, 0, -1]; RLOO s minus the mean of the others = [0, -1.5, 1.5] and [3, 0, -3]. Token estimators: the score on
    each row's last token, the recursion in plain Python, then whitened over all 14 response tokens of the batch."""
    if name in ("grpo", "rloo"):
        per_sample = {"grpo": [0.0, -1.0, 1.0, 1.0, 0.0, -1.0], "rloo": [0.0, -1.5, 1.5, 3.0, 0.0, -3.0]}[name]
        return torch.tensor(per_sample)[:, None] * MASK
    gamma, lam = SETTINGS.gamma, SETTINGS.lam
    rows = []
    for score, mask, values in zip(SCORES.tolist(), MASK.tolist(), VALUES.tolist(), strict=True):
        n = int(sum(mask))
        rewards = [0.0] * (n - 1) + [score]
        out, later, next_value = [0.0] * n, 0.0, 0.0
        for t in reversed(range(n)):
            if name == "reinforce_pp":
                later = rewards[t] + gamma * later
            else:  # gae: delta_t + gamma * lam * A_{t+1}
                later = rewards[t] + gamma * next_value - values[t] + gamma * lam * later
                next_value = values[t]
            out[t] = later
        rows.append(out)
    flat = [x for row in rows for x in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1) + 1e-8)
    return torch.tensor([[(x - mean) / std for x in row] + [0.0] * (3 - len(row)) for row in rows])


def test_every_contract_estimator_has_a_sharded_adapter_and_no_other():
    assert set(ESTIMATORS) == set(ADVANTAGES) == {"gae", "grpo", "rloo", "reinforce_pp"}
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; known: 'gae', 'grpo'"):
        get_estimator("ppo")


@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "reinforce_pp"])
def test_two_shares_together_give_the_whole_batchs_advantages_by_hand(name):
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
    whole = _by_hand(name)
    for r in (0, 1):
        assert_close(out[r], whole[SHARES[r]])
    # one share whitened alone (no reduce) would not be the whole batch's: the moments do matter for token estimators
    if name in ("gae", "reinforce_pp"):
        alone = AdvantageInputs(SCORES, GROUPS, SHARES[0], MASK[SHARES[0]], values=VALUES[SHARES[0]])
        assert not torch.allclose(get_estimator(name)(alone, SETTINGS)[0], whole[SHARES[0]])


def test_gae_without_the_critics_values_is_refused():
    with pytest.raises(AssertionError, match="critic's values"):
        get_estimator("gae")(AdvantageInputs(SCORES, GROUPS, SHARES[0], MASK[SHARES[0]]), SETTINGS)
