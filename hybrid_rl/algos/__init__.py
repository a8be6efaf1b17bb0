"""The pure-tensor algorithm core: advantage estimators, losses, reward shaping, KL control.

Imports only torch and the standard library (no torch.distributed, vLLM, Hydra or other
`hybrid_rl` layers): every function takes tensors and plain numbers and returns tensors, so it can
be tested on any machine. Recipes pick functions by name from the registries below; an unknown
name raises `ValueError` listing the known ones. The names and signatures follow the algorithm
contract (spec `algorithms.md`); keyword-only extras are additions, never changes.
"""

from __future__ import annotations

from .advantages import ADVANTAGES, gae, get_advantage, grpo, opd_advantages, reinforce_pp, rloo
from .groups import group_index, groups_with_signal
from .kl_control import AdaptiveKLController, FixedKLController, KLController
from .losses import (
    AGGREGATIONS,
    DPO_LOSSES,
    KL_ESTIMATORS,
    POLICY_LOSS_AGG,
    POLICY_LOSSES,
    aggregate,
    check_kl_estimator,
    check_loss_agg,
    cispo_loss,
    dpo_loss,
    entropy_from_logits,
    get_policy_loss,
    gspo_loss,
    kl,
    loss_denominators,
    policy_loss,
    value_loss,
)
from .masked import explained_variance, masked_mean, masked_sum, masked_var, masked_whiten
from .pairs import best_worst_pairs
from .shaping import overlong_penalty, token_rewards

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "DPO_LOSSES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "POLICY_LOSS_AGG",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "aggregate",
    "best_worst_pairs",
    "check_kl_estimator",
    "check_loss_agg",
    "cispo_loss",
    "dpo_loss",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "get_advantage",
    "get_policy_loss",
    "group_index",
    "groups_with_signal",
    "grpo",
    "gspo_loss",
    "kl",
    "loss_denominators",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "opd_advantages",
    "overlong_penalty",
    "policy_loss",
    "reinforce_pp",
    "rloo",
    "token_rewards",
    "value_loss",
]
