"""Routing replay's source: vLLM's selected experts for every token of every request, captured in vLLM's worker,
equal transformers' routing of the same tokens, for every (token, layer) pair; and in bfloat16, replaying them
lowers the log-prob mismatch between vLLM's rollout and the trainer's model.

The tiny model's routers are far from ties, so in bfloat16 vLLM and transformers choose the same experts for every
token and the mismatch is the same with and without replay; the worker pulls each router row to 1% of its distance
from the first (nearly tied expert logits, as a trained router's are for some tokens at real size), so that
bfloat16's rounding flips some choices: measured, agreement about 0.83 and a mean |log-prob difference| of 0.07
without replay against 0.005 with it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

WORKER = Path(__file__).parent / "workers" / "route_capture.py"
pytestmark = pytest.mark.slow


def test_captured_routes_equal_transformers_routing(tiny_models, tmp_path):
    out = tmp_path / "routes.json"
    paths = [tiny_models["qwen3_moe"], tiny_models["qwen3_moe_tied"]]
    proc = subprocess.run([sys.executable, str(WORKER), *paths], env=dict(os.environ, HR_TEST_OUT=str(out)), cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-4000:]
    r = json.loads(out.read_text())
    for path in paths:
        assert r[path]["layers"] == 2
        for req in r[path]["requests"]:
            assert req["shape"] == [req["tokens"], 2, 2]  # [prompt + generated - 1 tokens, MoE layers, top_k]
            assert req["dtype"] == "torch.uint8"  # carried compactly
            assert req["equal"], req
            assert req["replay_agreement"] == 1.0
    bf16 = r["bf16"]
    assert bf16["tokens"] >= 40 and bf16["agreement"] < 0.99, bf16  # routers did flip between vLLM and transformers
    assert bf16["mismatch"]["rollout"] < 0.5 * bf16["mismatch"]["none"], bf16
