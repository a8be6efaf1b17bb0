"""trainer.max_logprob_diff: the run stops when vLLM samples from other weights than the trainer's."""

import dataclasses

import pytest
import torch

from hybrid_rl.algos.correction import CorrectionSettings
from hybrid_rl.config import ConfigError, load_config, validate
from hybrid_rl.experience.batch import mismatch_metrics, sampler_logprobs
from hybrid_rl.experience.guard import MismatchGuard, PolicyMismatchError
from hybrid_rl.experience.source import TrainingError
from hybrid_rl.types import TrainBatch
from hybrid_rl.updates import response_mask
from tests.unit.trainer.samples import make_sample


def _batch():
    # Sample 0: |old - sampler| = (0, 1, 0.4); sample 1: 1.
    samples = [make_sample(0, [1, 2], [5, 6, 7], logprobs=[-1.0, -3.0, -0.1]),
               make_sample(1, [1, 2], [5], logprobs=[-2.0])]
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, 0.0, 0.0]])
    mask = response_mask(samples, 3)
    return TrainBatch(samples, mask, torch.zeros(2), old, torch.zeros(2, 3), rollout_logp=sampler_logprobs(samples, 3)), old


def test_the_guard_stops_a_run_above_the_limit_and_names_the_key():
    guard = MismatchGuard(0.15)
    guard.check({"rollout/logprob_diff_mean": 0.042}, step=3)  # SmolLM2 with a working sync (bf16 rollout)
    with pytest.raises(PolicyMismatchError, match=r"step 3: rollout/logprob_diff_mean = 0\.240 > "
                                                  r"trainer\.max_logprob_diff = 0\.15") as e:
        guard.check({"rollout/logprob_diff_mean": 0.24}, step=3)  # the smallest broken sync measured
    assert isinstance(e.value, TrainingError) and e.value.agreed  # exit 1, said once


@pytest.mark.parametrize("limit", [None, 0.0])
def test_null_or_zero_turns_the_guard_off(limit):
    MismatchGuard(limit).check({"rollout/logprob_diff_mean": 3.5}, step=1)


def test_async_runs_are_judged_on_the_tokens_of_the_steps_own_weights():
    batch, old = _batch()
    # Tokens 1 and 2 of sample 0 (diffs 1, 0.4) were sampled one version ago; the rest (0 and 1) by these weights.
    stale = dataclasses.replace(batch, staleness=torch.tensor([[0, 1, 1], [0, 0, 0]]))
    m = mismatch_metrics(stale, old, CorrectionSettings("none", "token", 0.5, 2.0), max_staleness=1)
    assert m["rollout/logprob_diff_mean"] == pytest.approx((0 + 1 + 0.4 + 1) / 4)
    assert m["rollout/logprob_diff_mean_own"] == pytest.approx((0 + 1) / 2)
    assert MismatchGuard.measured(m) == m["rollout/logprob_diff_mean_own"]
    # Every token stale: no figure at the step's own weights, nothing to judge.
    old_only = dataclasses.replace(batch, staleness=torch.ones(2, 3, dtype=torch.int64))
    m = mismatch_metrics(old_only, old, CorrectionSettings("none", "token", 0.5, 2.0), max_staleness=1)
    assert "rollout/logprob_diff_mean_own" not in m and MismatchGuard.measured(m) is None
    MismatchGuard(0.15).check(m, step=2)
    # Synchronous: every token is the step's own.
    m = mismatch_metrics(batch, old, CorrectionSettings("none", "token", 0.5, 2.0))
    assert MismatchGuard.measured(m) == m["rollout/logprob_diff_mean"]


def test_the_config_key_defaults_on_and_rejects_negative_values():
    base = ["model.path=/m", "data.train_files=[/x.jsonl]"]
    assert load_config("grpo", base).trainer.max_logprob_diff == 0.15
    assert load_config("grpo", [*base, "trainer.max_logprob_diff=null"]).trainer.max_logprob_diff is None
    with pytest.raises(ConfigError, match="trainer.max_logprob_diff"):
        validate(load_config("grpo", [*base, "trainer.max_logprob_diff=-1"]))
