"""The DPO family on sequence log-probs `[B]` (pairs of chosen and rejected responses).

Re-exported by `hybrid_rl.algos.losses`, where the contract names `dpo_loss`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .registry import lookup


def _dpo_sigmoid(z: Tensor, beta: float, label_smoothing: float) -> Tensor:
    # Label smoothing = the preference label is flipped with probability `label_smoothing` (cDPO).
    return -F.logsigmoid(z) * (1 - label_smoothing) - F.logsigmoid(-z) * label_smoothing


def _dpo_ipo(z: Tensor, beta: float, label_smoothing: float) -> Tensor:
    # IPO regresses the log-ratio margin z/beta onto 1/(2 beta) instead of pushing it to infinity.
    return (z / beta - 1 / (2 * beta)) ** 2


def _dpo_hinge(z: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return torch.relu(1 - z)


DPO_LOSSES: dict[str, Callable[[Tensor, float, float], Tensor]] = {
    "sigmoid": _dpo_sigmoid,
    "ipo": _dpo_ipo,
    "hinge": _dpo_hinge,
}


def dpo_loss(
    chosen_logp: Tensor,
    rejected_logp: Tensor,
    ref_chosen_logp: Tensor,
    ref_rejected_logp: Tensor,
    beta: float,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO-family loss per pair from sequence log-probs `[B]`.

    `z = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))`; `sigmoid`:
    `-logsigmoid(z) (1 - ls) - logsigmoid(-z) ls`; `ipo`: `(z/beta - 1/(2 beta))^2`; `hinge`:
    `relu(1 - z)`. `label_smoothing` is used by `sigmoid` only.

    Returns:
        `(losses [B], chosen_rewards [B], rejected_rewards [B])`, rewards `beta * (logp - ref_logp)`
        per side, detached (for logging reward accuracy and margins).
    """
    loss_fn = lookup(DPO_LOSSES, kind, kind="DPO loss kind")
    chosen_logratio = chosen_logp - ref_chosen_logp
    rejected_logratio = rejected_logp - ref_rejected_logp
    z = beta * (chosen_logratio - rejected_logratio)
    losses = loss_fn(z, beta, label_smoothing)
    return losses, (beta * chosen_logratio).detach(), (beta * rejected_logratio).detach()
