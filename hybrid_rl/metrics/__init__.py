"""Training metrics: per-step JSONL + TensorBoard + a progress bar on the main rank, and PNG plots.

    with MetricsLogger(run_dir, enabled=dims.is_main, total_steps=n, start_step=resumed_step) as metrics:
        metrics.log(step, {"reward/mean": 0.41, "timing/step_s": 3.2, ...})
    plot_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png")
"""

from hybrid_rl.metrics.logger import MetricsLogger
from hybrid_rl.metrics.plot import plot_metrics

__all__ = ["MetricsLogger", "plot_metrics"]
