"""MetricsLogger: metrics.jsonl (strict JSON, flushed per step, continued on resume), TensorBoard
scalars, the progress bar, and silence when disabled."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hybrid_rl.metrics import MetricsLogger
from hybrid_rl.metrics.logger import postfix


def _lines(run: Path) -> list[dict]:
    def no_nan_tokens(token: str):
        raise AssertionError(f"{token} in metrics.jsonl is not valid JSON")

    return [json.loads(line, parse_constant=no_nan_tokens) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _log_steps(run: Path, steps: range, *, start_step: int = 0, total: int = 10) -> None:
    with MetricsLogger(run, enabled=True, total_steps=total, start_step=start_step, show_progress=False) as m:
        for s in steps:
            m.log(s, {"reward/mean": s / 10, "timing/step_s": 1.5})


def test_each_step_is_one_json_line_written_before_close(tmp_path):
    m = MetricsLogger(tmp_path, enabled=True, total_steps=3, show_progress=False)
    m.log(1, {"reward/mean": 0.25, "actor/kl": 0.01})
    m.log(2, {"reward/mean": 0.5, "actor/kl": 0.02})
    assert _lines(tmp_path) == [{"step": 1, "reward/mean": 0.25, "actor/kl": 0.01},
                                {"step": 2, "reward/mean": 0.5, "actor/kl": 0.02}]  # flushed, not yet closed
    m.close()


def test_resume_drops_records_from_start_step_and_continues_the_same_file(tmp_path):
    _log_steps(tmp_path, range(1, 6))  # crashed after logging step 5, last checkpoint at step 2
    _log_steps(tmp_path, range(3, 8), start_step=3)
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3, 4, 5, 6, 7]


def test_resume_drops_a_line_cut_off_by_a_crash(tmp_path):
    _log_steps(tmp_path, range(1, 3))
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/me')
    _log_steps(tmp_path, range(3, 4), start_step=3)
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3]


def test_non_finite_values_are_written_as_null(tmp_path):
    with MetricsLogger(tmp_path, enabled=True, total_steps=1, show_progress=False) as m:
        m.log(1, {"a": math.nan, "b": math.inf, "c": -math.inf, "d": 2})
    assert _lines(tmp_path) == [{"step": 1, "a": None, "b": None, "c": None, "d": 2.0}]


def test_logging_a_step_again_merges_into_its_line(tmp_path):
    with MetricsLogger(tmp_path, enabled=True, total_steps=5, show_progress=False) as m:
        m.log(1, {"reward/mean": 0.5})
        m.log(2, {"reward/mean": 0.6})
        m.log(2, {"val/reward_mean": 0.7})  # validation after the training step
    assert _lines(tmp_path)[-1] == {"step": 2, "reward/mean": 0.6, "val/reward_mean": 0.7}
    assert len(_lines(tmp_path)) == 2


def test_going_back_to_an_earlier_step_is_refused(tmp_path):
    with MetricsLogger(tmp_path, enabled=True, total_steps=5, show_progress=False) as m:
        m.log(3, {"x": 1.0})
        with pytest.raises(ValueError, match="step 2 logged after step 3"):
            m.log(2, {"x": 1.0})


def test_a_metric_that_is_not_a_number_is_refused_with_a_fix(tmp_path):
    with MetricsLogger(tmp_path, enabled=True, total_steps=5, show_progress=False) as m:
        with pytest.raises(ValueError, match="'note'.*not a number.*item"):
            m.log(1, {"note": "hello"})


def test_tensorboard_scalars_are_written(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_steps(tmp_path, range(1, 4))
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_progress_bar_shows_reward_and_step_time_on_stderr(tmp_path, capsys):
    with MetricsLogger(tmp_path, enabled=True, total_steps=4) as m:
        m.log(1, {"reward/mean": 0.5, "timing/step_s": 2.25, "other/metric": 9.0})
    err = capsys.readouterr().err
    assert "1/4" in err and "reward=0.5" in err and "step_s=2.25" in err
    assert "other" not in err


def test_postfix_shows_what_is_present_and_stays_short():
    assert postfix({"step": 1, "timing/step_s": 3.14159}) == "step_s=3.14"
    long = {"reward/mean": 0.123456, "timing/step_s": 1234.5, "actor/kl": None, "response/length_mean": 512.0}
    assert postfix(long) == "reward=0.123 step_s=1.23e+03 kl=nan len=512"


def test_disabled_logger_writes_and_prints_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    with MetricsLogger(run, enabled=False, total_steps=3) as m:
        m.log(1, {"reward/mean": 0.5, "timing/step_s": 1.0})
    assert not run.exists()
    assert capsys.readouterr() == ("", "")
