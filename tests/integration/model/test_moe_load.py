"""A mixture of experts loaded sharded at start-up: each rank fuses its own experts from the per-expert tensors
on disk, bitwise what transformers' `from_pretrained` fuses; `export_hf` writes what plain transformers loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_torchrun

WORKER = Path(__file__).parent / "workers" / "moe_load.py"
pytestmark = pytest.mark.slow
CASES = ("qwen3_moe", "qwen3_moe_tied")


@pytest.fixture(scope="module")
def record(tiny_models, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe_load")
    return run_torchrun(WORKER, "--models", *[tiny_models[c] for c in CASES], "--out", str(root / "export"),
                        tmp_path=root)


@pytest.mark.parametrize("case", CASES)
def test_sharded_load_fuses_experts_bitwise_as_transformers(record, case):
    r = record[case]
    assert r["names_equal"] and r["params"] > 10
    assert r["unequal"] == []
    assert r["outputs_equal"]
    assert len(r["fused"]) == 4  # gate_up_proj and down_proj of 2 layers
    assert r["tied"] == (case == "qwen3_moe_tied")


@pytest.mark.parametrize("case", CASES)
def test_each_rank_reads_only_its_experts(record, case):
    r = record[case]
    assert r["experts_held"] * 2 == r["experts_total"]  # 2 ranks: half the experts of each fused tensor
    # What rank 0 read: half the expert bytes plus its rows of the other weights, in reads of at most 4 KiB.
    assert r["bytes_read"] <= r["expert_bytes_file"] / 2 + r["other_bytes"] / 2 + 4096
    assert r["bytes_read"] >= r["expert_bytes_file"] / 2
    assert r["largest_read"] <= 4096


@pytest.mark.parametrize("case", CASES)
def test_hf_export_is_what_plain_transformers_loads(record, case):
    r = record[case]
    assert r["export_keys_equal"]  # one tensor per expert on disk, as transformers saves (and vLLM loads)
    assert r["export_equal"] and r["export_outputs_equal"]
