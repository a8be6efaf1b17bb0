"""On 3 FSDP ranks (uneven shares, filler micro-batches) the update equals one plain micro-batch of the whole batch."""

from pathlib import Path

import pytest

from tests.conftest import run_torchrun

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "workers" / "units_fsdp.py"


def test_dpo_online_dpo_grpo_kl_and_critic_gradients_do_not_depend_on_ranks_or_budget(tiny_models, tmp_path):
    result = run_torchrun(WORKER, tiny_models["qwen2"], nproc=3, tmp_path=tmp_path, timeout=600)
    assert set(result) == {f"{c}@{b}" for c in ("dpo", "online_dpo", "grpo_kl", "critic") for b in (1, 10**6)}
    for case, r in result.items():
        assert r["error"] < 1e-4, (case, r)
        if case.startswith(("dpo", "online_dpo")):
            assert r["pairs_used"] == r["pairs"] > 0, (case, r)  # every pair trained, none dropped
