"""The end-to-end check of the weight sync: vLLM must sample from the weights the trainer trains.

`rollout/logprob_diff_mean` is the mean |trainer - sampler| log-prob per sampled token, the trainer's taken
at the step's own (pre-update) weights. With a working sync it is numerical noise (a bf16 rollout against
the trainer, measured: 0.006-0.018 on tiny models, 0.038-0.042 on SmolLM2-135M); when vLLM generates from
other weights (a sync that misses a weight or something vLLM derives from one) it is 0.24 and up. Above
`trainer.max_logprob_diff` (default 0.15, between the two) the run stops: every later sample would come from
another model.

Where the comparison means nothing, the guard stays quiet: tokens sampled by older weights (asynchronous
runs: only the age-0 tokens count, `rollout/logprob_diff_mean_own`). Truncated sampling (top-p / top-k), whose
log-probs would not be comparable, is refused by the config (`config._validate_truncation`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_rl.experience.source import TrainingError


class PolicyMismatchError(TrainingError):
    """vLLM's samples do not come from the trainer's weights (the same verdict on every rank)."""

    agreed = True  # the metric is all-reduced: every rank raises the same error, the entry point says it once


@dataclass(frozen=True)
class MismatchGuard:
    limit: float | None  # trainer.max_logprob_diff; None or 0: off

    @property
    def active(self) -> bool:
        return bool(self.limit)

    @staticmethod
    def measured(metrics: dict[str, float]) -> float | None:
        """The step's figure at its own weights; None when no token was sampled by them."""
        if "async/staleness_tokens_mean" in metrics:  # per-token ages known: only the age-0 tokens count
            return metrics.get("rollout/logprob_diff_mean_own")
        return metrics.get("rollout/logprob_diff_mean")

    def check(self, metrics: dict[str, float], step: int) -> None:
        value = self.measured(metrics)
        if not self.active or value is None or value <= self.limit:
            return
        raise PolicyMismatchError(
            f"step {step}: rollout/logprob_diff_mean = {value:.3f} > trainer.max_logprob_diff = {self.limit}: vLLM "
            "is sampling from other weights than the ones being trained (a working sync measures about 0.01-0.05 "
            "with a bf16 rollout), so training on these samples would train another model's rollouts. Nothing of "
            "this step was saved. Check that the model's architecture is supported (README, Supported models); "
            "trainer.max_logprob_diff=null turns this check off.")
