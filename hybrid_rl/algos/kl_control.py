"""KL-penalty coefficient controllers (for KL in the reward, or as a loss term).

`FixedKLController` keeps the coefficient; `AdaptiveKLController` is the proportional controller of
Ziegler et al. (2019), as in TRL and veRL: it nudges the coefficient so the measured KL tracks a
target. Both are checkpointed through `state_dict` / `load_state_dict`, as the coefficient is
training state.
"""

from __future__ import annotations

from typing import Protocol


class KLController(Protocol):
    """What a trainer uses: the current coefficient, one update per step, and checkpoint state."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """A constant coefficient; `update` does nothing."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller: `coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon`.

    The error is clipped to +-20% so one noisy KL estimate cannot swing the coefficient; `horizon`
    (in samples, like `n_steps`) sets how fast it moves.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0, got target={target}, horizon={horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards the one that makes `current_kl` hit the target."""
        error = min(max(float(current_kl) / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        # target and horizon come from the config; only the coefficient is state.
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
