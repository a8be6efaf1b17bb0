"""MetricsLogger: one call per step writes metrics.jsonl, TensorBoard scalars and a one-line progress bar.

Only the main rank logs: the trainer reduces metrics across ranks first and passes
`enabled=dims.is_main`, so the other ranks hold a logger that writes and prints nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from hybrid_rl.metrics.jsonl import JsonlWriter, to_record

# Progress-bar postfix: metric key -> short label, in display order; the first two always show when
# present, the rest only while the line stays short.
POSTFIX = {"reward/mean": "reward", "timing/step_s": "step_s", "actor/kl": "kl", "response/length_mean": "len"}
_ALWAYS = 2
_MAX_POSTFIX_CHARS = 60


class MetricsLogger:
    """Per-step metrics sinks under `out_dir`: metrics.jsonl, tensorboard/, and a tqdm bar on stderr.

    `start_step` is the first step this run will log: 0 for a fresh run; on resume, the step after
    the checkpoint's. Records from it on are dropped from metrics.jsonl (and hidden in TensorBoard)
    because those steps run again. The bar counts logging step s as s of `total_steps` done (steps
    numbered from 1, as the trainer does; step 0 is the evaluation before training).
    """

    def __init__(self, out_dir: str | Path, *, enabled: bool, total_steps: int, start_step: int = 0,
                 show_progress: bool = True):
        self.enabled = enabled
        self._last_step: int | None = None
        self._jsonl: JsonlWriter | None = None
        self._tb: Any = None
        self._bar: Any = None
        self._shown: dict[str, Any] = {}  # this step's metrics so far, for the bar
        if not enabled:
            return
        out = Path(out_dir)
        self._jsonl = JsonlWriter(out / "metrics.jsonl", start_step=start_step)
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides events at or after it, the same truncation as the JSONL file.
        self._tb = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start_step or None)
        if show_progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, file=sys.stderr, dynamic_ncols=True,
                             unit="step", desc="train")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record metrics for `step`. Logging the same step again (say, validation after training)
        adds to that step's record; going back to an earlier step is an error."""
        if not self.enabled:
            return
        if self._last_step is not None and step < self._last_step:
            raise ValueError(f"metrics for step {step} logged after step {self._last_step}: steps must not go back")
        new_step = step != self._last_step
        self._last_step = step
        record = to_record(step, metrics)
        self._jsonl.write(record)
        for key, value in record.items():
            if key != "step":
                self._tb.add_scalar(key, float("nan") if value is None else value, global_step=step)
        self._tb.flush()
        if self._bar is not None:
            self._shown = {**self._shown, **record} if not new_step else record
            self._bar.set_postfix_str(postfix(self._shown), refresh=False)
            self._bar.update(max(0, min(step, self._bar.total) - self._bar.n))  # also redraws the postfix

    def close(self) -> None:
        """Flush and close every sink (safe to call twice)."""
        for sink in (self._bar, self._tb, self._jsonl):
            if sink is not None:
                sink.close()
        self._bar = self._tb = self._jsonl = None
        self.enabled = False

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def postfix(record: dict[str, Any]) -> str:
    """'reward=0.512 step_s=3.1 kl=0.002': the POSTFIX keys present, cut when the line grows long."""
    parts: list[str] = []
    for key, label in POSTFIX.items():
        if key not in record:
            continue
        value = record[key]
        part = f"{label}={'nan' if value is None else f'{value:.3g}'}"
        if len(parts) >= _ALWAYS and len(" ".join([*parts, part])) > _MAX_POSTFIX_CHARS:
            break
        parts.append(part)
    return " ".join(parts)
