"""Start-up the trainer's way (meta device, shard, each rank reads only its rows) = `from_pretrained` + shard.

One 2-rank torchrun launch (`workers/sharded_load.py`) builds each model both ways through the real
`build.py` functions and records what it saw; each test below checks one behaviour of that record.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_torchrun

WORKER = Path(__file__).parent / "workers" / "sharded_load.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def record(tiny_models, tmp_path_factory) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("sharded_load")
    qwen2 = tiny_models["qwen2"]
    # The tiny model saved in bf16 over several files (model.safetensors.index.json), as large checkpoints are.
    sharded = AutoModelForCausalLM.from_pretrained(qwen2, dtype=torch.bfloat16)
    sharded.save_pretrained(root / "sharded_bf16", max_shard_size="300KB")
    assert len(list((root / "sharded_bf16").glob("*.safetensors"))) > 2
    # A reward model: sequence classification with its own (trained) head in the checkpoint.
    torch.manual_seed(1)
    AutoModelForSequenceClassification.from_pretrained(qwen2, num_labels=1).save_pretrained(root / "reward")
    # A few hundred MB (fp32) for the memory check: 66M parameters, saved in bf16.
    config = AutoConfig.from_pretrained(qwen2)
    config.update(dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=32000, layer_types=["full_attention"] * 8))
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(root / "big")
    models = {"qwen2": qwen2, "llama_tied_kv1": tiny_models["llama_tied_kv1"], "sharded_bf16": str(root / "sharded_bf16"),
              "reward": str(root / "reward"), "big": str(root / "big")}
    return run_torchrun(WORKER, "--models", json.dumps(models), tmp_path=root)


@pytest.mark.parametrize("case", ["qwen2", "llama_tied_kv1", "sharded_bf16", "chunked", "critic", "reward", "lora"])
def test_parameters_and_outputs_are_bitwise_those_of_from_pretrained(record, case):
    r = record[case]
    assert r["names_equal"] and r["params"] > 10
    assert r["params_equal"] == r["params"], r["unequal"]
    assert r["outputs_equal"]


def test_a_tied_head_stays_the_embedding(record):
    assert record["llama_tied_kv1"]["tied"]
    assert not record["qwen2"]["tied"]


def test_trainable_parameters_are_those_of_the_old_way(record):
    for case in ("qwen2", "llama_tied_kv1", "lora"):
        assert record[case]["trainable_equal"], case


def test_new_parameters_are_the_same_whatever_the_world_size(record):
    # Gathered from 2 ranks = the whole tensor built from the seeded generator on one process.
    lora = record["lora"]["new_params"]
    assert len(lora) == 2 * 3 * 2 and all(lora.values()), lora  # A and B of 3 targets in each of 2 layers
    assert record["critic"]["new_params"] == {"score.weight": True, "score.bias": True}


def test_reward_model_head_comes_from_its_checkpoint(record):
    assert record["reward"]["score_equal"]


def test_frozen_model_in_bf16_computes_what_fp32_shards_cast_to_bf16_do(record):
    r = record["frozen_bf16"]
    assert r["dtypes"] == ["torch.bfloat16"]
    assert r["outputs_equal"]


def test_each_rank_reads_only_its_rows_in_bounded_reads(record):
    r = record["chunked"]
    assert r["bytes_read"] == r["bytes_mine"]
    assert 0.4 * r["bytes_file"] < r["bytes_read"] < 0.6 * r["bytes_file"]  # about half of it at 2 ranks
    assert r["largest_read"] <= 3000


def test_a_rank_materialises_its_share_not_the_model(record):
    for rank in record["memory"]:
        assert rank["share"] < 0.55 * rank["model"]
        # Peak RSS growth while building: its shards plus less than one decoder block (the read buffer).
        assert rank["growth"] <= rank["share"] + rank["block"], rank


def _tied_allocations(rank: int, port: int, path: str, results) -> None:
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hybrid_rl.distributed.fsdp import shard_model
    from hybrid_rl.model.loading import empty_model, load_causal_lm
    from hybrid_rl.model.materialize import materialize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = shard_model(empty_model(path, "lm"), init_device_mesh("cpu", (1,)), param_dtype=torch.float32)
    shape = tuple(model.get_input_embeddings().weight.shape)
    allocated, empty_like = [], torch.empty_like

    def spy(t, *args, **kwargs):
        allocated.append(tuple(t.shape))
        return empty_like(t, *args, **kwargs)

    torch.empty_like = spy
    try:
        materialize(model, path, device="cpu")
    finally:
        torch.empty_like = empty_like
    reference = load_causal_lm(path)
    results["out"] = dict(
        embedding_allocations=allocated.count(shape),
        tied=model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        equal=all(torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), reference.parameters(),
                                                                    strict=True)))
    dist.destroy_process_group()


def test_a_tied_weight_is_allocated_once(tiny_models):
    """`to_empty` allocates a tensor per module registration, so a tied head used to hold a second copy of the
    embedding for a moment: at Qwen2.5-0.5B's shape on an H100, 0.25 GiB of bf16 above the start-up plan."""
    import torch.multiprocessing as mp

    from hybrid_rl.distributed.mesh import free_port

    results = mp.Manager().dict()
    mp.spawn(_tied_allocations, args=(free_port(), tiny_models["llama_tied_kv1"], results), nprocs=1, join=True)
    assert results["out"] == dict(embedding_allocations=1, tied=True, equal=True)
