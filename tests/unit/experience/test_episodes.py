"""Black-box agent episodes stitched into several trajectories: every trajectory is a trained sample, each with its
episode's score, and group statistics count episodes, not pieces.

The experience buffer runs for real in a world of one (its collectives are the identity there) on a scripted
streaming worker: each request's episode is given as its trajectories' lengths (0: an infrastructure failure); the
scored trajectory is the last, whose first id is the episode's score.
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch

from hybrid_rl.algos.estimators import AdvantageSettings
from hybrid_rl.data import PromptRecord
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.experience import batch as exp_batch
from hybrid_rl.experience.buffered import BufferedSource
from hybrid_rl.experience.passes import PassOutputs
from hybrid_rl.experience.share import make_share, ranked_pairs, singles
from hybrid_rl.experience.source import SourceSettings
from hybrid_rl.rollout.base import Arrival, SyncReport
from hybrid_rl.types import Generation
from hybrid_rl.utils.timer import PhaseTimer

N = 4  # rollout.n


@dataclass
class _Result:
    totals: list[float]
    by_name: dict
    failures: tuple = ()
    elapsed_s: float = 0.0


class _Done:
    def __init__(self, result):
        self.result_ = result

    def done(self):
        return True

    def result(self):
        return self.result_


class _FirstIdScorer:
    """The reward judges the held (scored) sample only: its first response id is its score."""

    part_names = ["first_id"]

    def start(self, held):
        totals = [float(s.response_ids[0]) if s.response_len else 0.0 for s in held]
        return _Done(_Result(totals, {"first_id": totals}))


class _ScriptedAgent:
    """A streaming rollout worker whose request `key` plays the episode `episodes[key]`: (trajectory lengths, score)."""

    def __init__(self, episodes: dict[int, tuple[list[int], int]], version: int = 0):
        self.episodes, self.version, self.pending = episodes, version, []

    def session(self, version=None):
        return nullcontext()

    def last_sync(self):
        return SyncReport()

    def submit(self, requests, *, greedy=False):
        self.pending += requests

    def arrivals(self):
        out = {r.key: self._episode(r.key) for r in self.pending}
        self.pending = []
        return out, {}

    def in_flight(self):
        return 0

    def recover(self):
        pass

    def _episode(self, key: int) -> Arrival:
        lengths, score = self.episodes[key]
        if not lengths:
            return Arrival(Generation(0, (), (), "stop"), torch.zeros(0, dtype=torch.int64), infra_failed=True,
                           stats={"n": 1.0, "infra": 1.0})
        trajs = []
        for k, length in enumerate(lengths):
            ids = (score if k == len(lengths) - 1 else 100 + k, *range(1, length))  # the last: the score first
            trajs.append(Arrival(Generation(0, ids, (-0.5,) * length, "stop"),
                                 torch.full((length,), self.version, dtype=torch.int64),
                                 torch.ones(length, dtype=torch.bool), prompt_ids=(7, key, k)))
        *earlier, last = trajs
        return Arrival(last.generation, last.token_versions, last.loss_mask, {"env_reward": float(score)},
                       stats={"n": 1.0, "trajectories": float(len(lengths))}, prompt_ids=last.prompt_ids,
                       earlier=tuple(earlier))


class _Loader:
    def __init__(self):
        self.next = 0

    def __iter__(self):
        return self

    def __next__(self):
        out = [PromptRecord(i, f"p{i}", (i,), {"row": i}) for i in range(self.next, self.next + 2)]
        self.next += 2
        return out


def _source(episodes, version: int = 0) -> BufferedSource:
    settings = SourceSettings(n=N, prompts_per_step=2, dynamic_sampling=False, max_sampling_rounds=1,
                              offline_pairs=False, max_staleness=0, seed=0, max_restarts=1)
    return BufferedSource(_ScriptedAgent(episodes, version), _Loader(), _FirstIdScorer(),
                          ParallelDims(world=1, rank=0, local_rank=0, tp=1), PhaseTimer(), lambda v: nullcontext(),
                          settings)


def _advantages(exp, estimator: str, version: int = 0):
    """The trainer's path from the batch to its advantages in a world of one: share, outcome scores, `train_batch`."""
    settings = exp_batch.BatchSettings(estimator, AdvantageSettings(), False, "k1", 64, 0, 0.0, 0.0)
    mine = make_share(exp.rollout, singles(exp.rollout.index), ParallelDims(1, 0, 0, 1), paired=False,
                      fields_of=exp.fields.get)
    scores = exp_batch.outcome_scores(exp.scoring.result(), PassOutputs(), mine, settings)
    batch = exp_batch.train_batch(mine, scores, PassOutputs(), settings, kl_coef=0.0, version=version)
    return mine, batch


# group 0: episodes of 1, 2, 3 and 1 trajectories; group 1: 2, an infrastructure failure, 1, 1
EPISODES = {0: ([3], 1), 1: ([2, 4], 0), 2: ([2, 1, 3], 1), 3: ([5], 0),
            4: ([2, 2], 3), 5: ([], 0), 6: ([1], 1), 7: ([4], 2)}


def test_every_trajectory_is_a_sample_at_consecutive_uids_with_its_episodes_score():
    exp = _source(EPISODES).next_batch(1)
    index, held = exp.rollout.index, exp.rollout.held
    assert [s.uid for s in held] == list(range(11))  # 7 trajectories in group 0, 4 in group 1 (the failure dropped)
    assert [s.part for s in held] == [0, 0, 1, 0, 1, 2, 0, 0, 1, 0, 0]
    assert index.parts.tolist() == [0, 0, 1, 0, 1, 2, 0, 0, 1, 0, 0]
    assert index.groups.tolist() == [0] * 7 + [1] * 4
    assert index.episodes.tolist() == [0, 1, 1, 2, 2, 2, 3, 4, 4, 5, 6]
    assert index.episode_ends.tolist() == [True, False, True, False, False, True, True, False, True, True, True]
    # each trajectory keeps its own prompt and ids; the scored one is the episode's last
    assert [tuple(s.prompt_ids.tolist()) for s in held[3:6]] == [(7, 2, 0), (7, 2, 1), (7, 2, 2)]
    assert [s.response_len for s in held[3:6]] == [2, 1, 3] and int(held[5].response_ids[0]) == 1
    scores = exp.scoring.result()
    assert scores.total.tolist() == [1, 0, 0, 1, 1, 1, 0, 3, 3, 1, 2]
    assert scores.parts["first_id"].tolist() == scores.total.tolist()
    assert exp.metrics["rollout/trajectories_per_episode"] == 11 / 8  # the failure counts as an episode of none
    assert exp.metrics["rollout/infra_failed_rate"] == 1 / 8
    # the reward metrics are over episodes (7 survivors), not trajectories
    metrics = exp_batch.reward_metrics(scores, index)
    assert metrics["reward/mean"] == pytest.approx(8 / 7) and metrics["reward/max"] == 3


def test_group_advantages_are_per_episode_and_shared_by_its_trajectories():
    exp = _source(EPISODES).next_batch(1)
    episode_scores = torch.tensor([1.0, 0, 1, 0, 3, 1, 2])
    episode_of = exp.rollout.index.episodes
    # By hand, one row per episode. Group 0 [1, 0, 1, 0]: mean 1/2, unbiased std 1/sqrt(3); group 1 [3, 1, 2]:
    # mean 2, std 1. GRPO: (s - mean) / std; RLOO: s minus the mean of the group's other episodes.
    half_sqrt3 = math.sqrt(3) / 2
    by_hand = {"grpo": [half_sqrt3, -half_sqrt3, half_sqrt3, -half_sqrt3, 1.0, -1.0, 0.0],
               "rloo": [2 / 3, -2 / 3, 2 / 3, -2 / 3, 1.5, -1.5, 0.0]}
    for name, hand in by_hand.items():
        mine, batch = _advantages(exp, name)
        assert [s.part for s in mine.samples] == exp.rollout.index.parts[mine.rows].tolist()  # through the exchange
        expected = torch.tensor(hand)
        got = batch.advantages[:, 0]  # every response token of a row has the row's advantage
        assert torch.allclose(got, expected[episode_of[mine.rows]]), name
        assert torch.equal(batch.scores, episode_scores[episode_of[mine.rows]])
    # the same episodes, each one trajectory: the same advantages, so splitting does not skew the group statistics
    whole = {k: ([1] if lengths else [], score) for k, (lengths, score) in EPISODES.items()}
    one = _source(whole).next_batch(1)
    assert one.rollout.index.episodes is None and one.rollout.index.size == 7
    _, single = _advantages(one, "grpo")
    _, split = _advantages(exp, "grpo")
    ends = exp.rollout.index.episode_ends
    assert torch.allclose(split.advantages[ends, 0], single.advantages[:, 0])


def test_token_versions_reach_the_staleness_and_online_dpo_pairs_only_judged_trajectories():
    exp = _source(EPISODES, version=3).next_batch(1)
    _, batch = _advantages(exp, "grpo", version=5)
    assert batch.staleness is not None
    assert bool((batch.staleness[batch.mask] == 2).all())  # every trajectory's tokens: sampled at 3, trained at 5
    pairs = ranked_pairs(exp.rollout.index, exp.scoring.result().total)
    ends = set(exp.rollout.index.episode_ends.nonzero().flatten().tolist())
    assert pairs and all(u in ends for pair in pairs for u in pair)


def test_an_episodes_earlier_trajectories_and_its_failures_are_in_the_checkpoint():
    source = _source(EPISODES)
    source._dispatch_regular(0)
    source._collect()
    state, rank_state = source.state_dict(), source.rank_state()
    again = _source(EPISODES)
    again.load_state_dict(state, rank_state)
    assert {k: [x.part for x in xs] for k, xs in again.earlier.items()} == {1: [0], 2: [0, 1], 4: [0]}
    assert again.infra == {5}  # the infrastructure failure stays one: not trained as an empty response
    assert not again.resend  # every sample was finished: none to send again
    exp = again.next_batch(1)
    assert exp.rollout.index.size == 11
