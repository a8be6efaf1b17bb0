"""On-policy distillation in the batch: the teacher's log-prob gap shapes the estimator's advantages (or, with no
reward, is the whole advantage), and `opd/reverse_kl` is the sequence-mean of the per-token k1 estimate."""

import math

import pytest
import torch

from hybrid_rl.algos import aggregate, grpo, kl
from hybrid_rl.algos.estimators import AdvantageSettings
from hybrid_rl.experience import batch as exp_batch
from hybrid_rl.experience.passes import PassOutputs
from hybrid_rl.experience.share import Share
from hybrid_rl.types import BatchIndex
from tests.unit.trainer.samples import make_sample

# Two prompts' groups of two; responses of 3, 1, 2 and 3 tokens.
RESPONSES = [[11, 12, 13], [14], [15, 16], [17, 18, 19]]
STUDENT = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, 0.0, 0.0], [-1.0, -1.0, 0.0], [-0.2, -0.4, -0.6]])
TEACHER = torch.tensor([[-1.5, -1.0, -0.5], [-60.0, 0.0, 0.0], [-1.0, -3.0, 0.0], [-0.2, -0.2, -0.2]])
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0])


def _share() -> Share:
    samples = [make_sample(i, [1, 2], r, group=i // 2) for i, r in enumerate(RESPONSES)]
    lens = torch.tensor([len(r) for r in RESPONSES])
    index = BatchIndex(torch.full((4,), 2), lens, torch.tensor([0, 0, 1, 1]), torch.zeros(4, dtype=torch.bool))
    return Share(samples, torch.arange(4), index, False, 4)


def _batch(coef: float, distil_only: bool):
    s = exp_batch.BatchSettings("grpo", AdvantageSettings(), False, "k1", 8, 0, 0.0, 0.0, coef, distil_only=distil_only)
    passes = PassOutputs(old_logp=STUDENT, teacher_logp=TEACHER)
    return exp_batch.train_batch(_share(), SCORES, passes, s, kl_coef=0.0, version=0)


def test_pure_distillation_advantage_is_minus_the_gap():
    b = _batch(1.0, distil_only=True)
    # -(student - teacher) on real tokens: row 0: -0.5, +1, 0; row 1: -57 (a teacher log-prob of -60 is not
    # clamped); row 2: 0, -2; row 3: 0, +0.2, +0.4. Zero past each response.
    want = torch.tensor([[-0.5, 1.0, 0.0], [-57.0, 0.0, 0.0], [0.0, -2.0, 0.0], [0.0, 0.2, 0.4]])
    torch.testing.assert_close(b.advantages, want)
    torch.testing.assert_close(b.teacher_logp, TEACHER)


def test_distillation_on_top_of_the_estimator():
    b = _batch(0.5, distil_only=False)
    mask = b.mask.float()
    # GRPO on groups (1, 0) and (0, 1): +-0.5/(std + eps) with the unbiased std sqrt(0.5), minus half the gap
    # (row 0, token 0: student - teacher = 0.5, so 0.7071 - 0.25).
    g = grpo(SCORES, [0, 0, 1, 1], mask)
    torch.testing.assert_close(b.advantages, (g - 0.5 * (STUDENT - TEACHER)) * mask)
    assert b.advantages[0, 0] == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6) - 0.25)
    # opd_coef 0: the estimator's advantages unchanged.
    torch.testing.assert_close(_batch(0.0, distil_only=False).advantages, g)


def test_reverse_kl_metric_is_the_sequence_mean_of_k1():
    b = _batch(1.0, distil_only=True)
    # Row token means of student - teacher: row 0: (0.5 - 1 + 0)/3; row 1: 57; row 2: (0 + 2)/2; row 3: -0.6/3.
    rows = [(0.5 - 1.0 + 0.0) / 3, 57.0, 1.0, (0.0 - 0.2 - 0.4) / 3]
    m = exp_batch.distillation_metrics(b, STUDENT)
    assert m == {"opd/reverse_kl": pytest.approx(sum(rows) / 4)}
    spec = aggregate(kl(STUDENT, TEACHER, "k1"), b.mask, "seq-mean-token-mean")  # the contract's formula
    assert m["opd/reverse_kl"] == pytest.approx(float(spec))
