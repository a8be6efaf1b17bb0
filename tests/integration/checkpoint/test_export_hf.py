"""HF export of an FSDP2-sharded policy on 2 real gloo ranks: `from_pretrained` of the folder gives the
FSDP model's logits (float32), for untied and tied embeddings; tied weights are written once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hybrid_rl.checkpoint import export_hf
from hybrid_rl.checkpoint.hf_export import hf_tensors

from .harness import batch, sharded_model, spawn, train_step


def _scenario(rank: int, world: int, rec: dict, model_dirs: dict[str, str], root: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name, model_dir in model_dirs.items():
        model, opt = sharded_model(model_dir, world)
        train_step(model, opt, seed=5)  # export the trained weights, not the ones on disk
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        out = export_hf(model, tokenizer, Path(root) / name, rank=rank)
        ids = batch(seed=11)
        with torch.no_grad():
            fsdp_logits = model(input_ids=ids).logits  # collective: every rank runs it
        if rank != 0:
            continue
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            hf_logits = hf(input_ids=ids).logits
        with safe_open(out / "model.safetensors", "pt") as f:
            keys = set(f.keys())
        rec[name] = {
            "max_abs_diff": float((hf_logits - fsdp_logits).abs().max()),
            "has_lm_head": "lm_head.weight" in keys,
            "tied_after_load": hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr(),
            "tokenizer_same": AutoTokenizer.from_pretrained(out)("12 + 7").input_ids == tokenizer("12 + 7").input_ids,
            "files": sorted(os.listdir(out)),
            "siblings": sorted(os.listdir(root)),
        }


@pytest.fixture(scope="module")
def exported(untied_model, tied_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("export")
    return spawn(_scenario, {"untied": untied_model, "tied": tied_model}, str(root))[0]


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_exported_folder_reproduces_the_fsdp_model_logits(exported, name):
    assert exported[name]["max_abs_diff"] <= 1e-6


def test_tied_embeddings_are_written_once_and_stay_tied(exported):
    assert not exported["tied"]["has_lm_head"]
    assert exported["tied"]["tied_after_load"]
    assert exported["untied"]["has_lm_head"] and not exported["untied"]["tied_after_load"]


def test_export_is_a_complete_hf_folder_with_no_temp_dir_left(exported):
    for name in ("untied", "tied"):
        files = exported[name]["files"]
        for required in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
            assert required in files
        assert exported[name]["tokenizer_same"]
    assert exported["tied"]["siblings"] == ["tied", "untied"]


def test_wrapper_prefixes_are_stripped_from_names():
    w = torch.zeros(2)
    full = {"_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight": w,
            "_orig_mod.model.embed_tokens.weight": w, "_orig_mod.lm_head.weight": w}
    names = set(hf_tensors(full, tied={"lm_head.weight"}, dtype=None))
    assert names == {"model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"}


def test_large_exports_are_split_into_indexed_shards(untied_model, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(untied_model, dtype=torch.float32)
    out = export_hf(model, None, tmp_path / "sharded", rank=0, dtype=torch.bfloat16, max_shard_bytes=300_000)
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.dtype == torch.bfloat16
    for (n, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a.to(torch.bfloat16), b), n
