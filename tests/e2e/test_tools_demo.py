"""The tools demo, shortened: GRPO with the python tool raises the held-out reward while the tool-call rate rises.

The warmed-up model calls the tool in about 30% of its samples, so greedy decoding (the held-out score) guesses and
scores about 0; a guess at a 6-digit product is never right, a call is. Five steps of 8 prompts x 8 samples are
enough for the sampled call rate to pass one half (measured with the test's warm-up, 200 steps of 16 conversations:
0.23, 0.44, 0.64, 0.83, 0.88 at steps 1-5; held-out reward 0.00 -> 0.98; with 120 steps the calls stay malformed
and the held-out reward 0), and from then the greedy answer calls too.
"""

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_short_tools_demo_raises_held_out_reward_and_tool_calls(tools_demo_root):
    r = subprocess.run([sys.executable, "-m", "hybrid_rl.demo", "--task", "tools", "--steps", "5", "--prompts", "8",
                        "--val-points", "1", "--out", str(tools_demo_root)],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rate_line, reward_line = r.stdout.strip().splitlines()[-2:]
    m = re.fullmatch(r"held-out reward: ([0-9.]+) -> ([0-9.]+)", reward_line)
    assert m, reward_line
    before, after = map(float, m.groups())
    assert after - before >= 0.2, f"RL did not raise the held-out reward clearly: {before} -> {after}"
    m = re.fullmatch(r"held-out tool-call rate: ([0-9.]+) -> ([0-9.]+)", rate_line)
    assert m, rate_line
    rate_before, rate_after = map(float, m.groups())
    assert rate_after > rate_before, f"the held-out tool-call rate did not rise: {rate_before} -> {rate_after}"
    rows = [json.loads(line) for line in (tools_demo_root / "tools_grpo" / "metrics.jsonl").read_text().splitlines()]
    rates = [row["rollout/tool_call_rate"] for row in rows if "rollout/tool_call_rate" in row]
    assert rates[-1] > rates[0], f"the sampled tool-call rate did not rise: {rates}"
