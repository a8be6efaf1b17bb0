"""plot_metrics: a PNG with one subplot per present metric; a clear error when none is present."""

from __future__ import annotations

import json

import pytest

from hybrid_rl.metrics import plot_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "reward/mean": s / 20, "actor/kl": None if s == 3 else 0.01 * s, "timing/step_s": 2.0}
            for s in range(1, 21)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plot_is_a_png_with_real_content(jsonl, tmp_path):
    out = plot_metrics(jsonl, tmp_path / "plots" / "metrics.png", title="tiny run")
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000  # two drawn subplots, not an empty canvas


def _height_px(png: bytes) -> int:
    return int.from_bytes(png[20:24], "big")  # IHDR: width at bytes 16-19, height at 20-23


def test_absent_keys_are_skipped(jsonl, tmp_path):
    one = plot_metrics(jsonl, tmp_path / "one.png", keys=("reward/mean", "response/length_mean"))
    two = plot_metrics(jsonl, tmp_path / "two.png", keys=("reward/mean", "actor/kl"))
    # The figure grows by one fixed-height row per subplot: one row where the second key is absent.
    assert _height_px(two.read_bytes()) == 2 * _height_px(one.read_bytes())


def test_no_present_key_is_a_value_error_listing_the_available_ones(jsonl, tmp_path):
    with pytest.raises(ValueError, match=r"none of \['critic/loss'\].*actor/kl.*reward/mean.*timing/step_s"):
        plot_metrics(jsonl, tmp_path / "x.png", keys=("critic/loss",))
    assert not (tmp_path / "x.png").exists()
