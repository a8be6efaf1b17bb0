"""Models built the trainer's way (meta device, shard, each rank reads its rows) against `from_pretrained` + shard.

Run under torchrun (2 ranks); rank 0 writes a JSON record to $HR_TEST_OUT. For each case both models
are FSDP2-sharded the same way; the record holds whether the gathered parameters and the outputs
of a forward pass are bitwise equal, and what the new path read and initialised.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hybrid_rl.build import _actor, _critic, _frozen  # noqa: E402
from hybrid_rl.config import Config  # noqa: E402
from hybrid_rl.distributed.fsdp import local_rows, local_tensor, shard_model  # noqa: E402
from hybrid_rl.distributed.mesh import device, fsdp_mesh, init_distributed  # noqa: E402
from hybrid_rl.model.loading import (  # noqa: E402
    DTYPES,
    empty_model,
    load_causal_lm,
    load_critic,
    load_reward_model,
)
from hybrid_rl.model.lora import apply_lora, hf_name  # noqa: E402
from hybrid_rl.model.materialize import initial_value, materialize  # noqa: E402
from hybrid_rl.model.weight_files import WeightFiles  # noqa: E402
from hybrid_rl.utils import memory  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--models", required=True, help="JSON: case name -> model folder")
a = p.parse_args()
MODELS = json.loads(a.models)
dims = init_distributed(1)
IDS = torch.tensor([[5, 17, 200, 33, 8, 90, 41, 7, 300, 12, 64, 3], [9, 9, 120, 77, 2, 51, 18, 250, 6, 44, 100, 1]])
LORA = dict(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])


def config(path: str, *, dtype: str = "float32", lora: int = 0) -> Config:
    cfg = Config()
    cfg.model.path, cfg.model.dtype, cfg.trainer.seed = path, dtype, 7
    cfg.model.lora = dataclasses.replace(cfg.model.lora, rank=lora, alpha=LORA["alpha"],
                                         target_modules=LORA["target_modules"])
    return cfg


def old_way(module: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """What build.py did before: the whole model on every rank, moved to the device, then sharded."""
    module.to(device())
    return shard_model(module, fsdp_mesh(dims), param_dtype=DTYPES[dtype])


def gathered(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in module.named_parameters()}


@torch.no_grad()
def outputs(module: torch.nn.Module) -> torch.Tensor:
    logits = module(input_ids=IDS.to(device())).logits.float()
    return logits.log_softmax(-1) if logits.shape[-1] > 1 else logits


def compare(new: torch.nn.Module, old: torch.nn.Module) -> dict:
    gn, go = gathered(new), gathered(old)
    skip = {n for n in gn if ".lora_" in n or n.startswith("score.")}  # new parameters: checked on their own
    same = [n for n in go if n not in skip and torch.equal(gn[n].float(), go[n].float())]
    return {"names_equal": sorted(gn) == sorted(go), "params": len(go) - len(skip), "params_equal": len(same),
            "unequal": sorted(set(go) - skip - set(same))[:5], "outputs_equal": torch.equal(outputs(new), outputs(old))}


def copy_head(new: torch.nn.Module, old: torch.nn.Module) -> None:
    """Give the old model the new one's (randomly initialised) head, so outputs compare the loaded backbone."""
    olds = dict(old.named_parameters())
    with torch.no_grad():
        for n, p in new.named_parameters():
            if n.startswith("score."):
                local_tensor(olds[n]).copy_(local_tensor(p))


def new_params(module: torch.nn.Module, seed: int) -> dict:
    """Gathered new parameters against the value `materialize` defines for them (whatever the world size)."""
    out = {}
    for n, t in gathered(module).items():
        name = hf_name(n)
        if ".lora_B." in name or (name.startswith("score.") and name.endswith("bias")):
            out[name] = bool((t == 0).all())
        elif ".lora_A." in name or name.startswith("score."):
            out[name] = torch.equal(t.float(), initial_value(name, tuple(t.shape), seed=seed))
    return out


record: dict = {}

# Plain causal LM (fp32 checkpoint), a tied head, and a bf16 checkpoint in indexed shards.
for case in ("qwen2", "llama_tied_kv1", "sharded_bf16"):
    path = MODELS[case]
    new = _actor(config(path), dims).module
    old = old_way(load_causal_lm(path), "float32")
    record[case] = compare(new, old)
    record[case]["tied"] = new.lm_head.weight is new.model.embed_tokens.weight
    record[case]["trainable_equal"] = ([n for n, p in new.named_parameters() if p.requires_grad]
                                       == [n for n, p in old.named_parameters() if p.requires_grad])

# Memory (right after the first case, so that imports and first-use allocations are behind): building a model
# of a few hundred MB grows each rank's RSS by its share, not by the model.
path = MODELS["big"]
rss = memory.rss_bytes()
memory.reset_peak_rss()
new = _frozen(path, "lm", config(path), dims).module
mem = {"growth": memory.peak_rss_bytes() - rss, "share": sum(local_tensor(p).nbytes for p in new.parameters()),
       "model": sum(p.numel() * 4 for p in new.parameters()),
       "block": max(sum(p.numel() * 4 for p in b.parameters()) for b in new.model.layers)}
record["memory"] = [None] * dims.world
dist.all_gather_object(record["memory"], mem)
del new


# Reads of at most 3000 bytes give the same model; every read is this rank's rows, and nothing else.
path = MODELS["sharded_bf16"]
new = shard_model(empty_model(path, "lm"), fsdp_mesh(dims), param_dtype=torch.float32)
report = materialize(new, path, device=device(), chunk_bytes=3000)
files = WeightFiles(path)
mine = sum((b - a) * files.row_bytes(hf_name(n)) for n, p in new.named_parameters() for a, b in [local_rows(p)])
total = sum(files.shape(k)[0] * files.row_bytes(k) for k in files.file_of)
record["chunked"] = compare(new, old_way(load_causal_lm(path), "float32"))
record["chunked"].update(bytes_read=report.bytes_read, bytes_mine=mine, bytes_file=total,
                         largest_read=report.largest_read)

# Critic: the backbone from the policy folder, a new value head.
path = MODELS["qwen2"]
new = _critic(config(path), dims).module
old = old_way(load_critic(path), "float32")
record["critic"] = {"new_params": new_params(new, seed=7)}
copy_head(new, old)
record["critic"].update(compare(new, old))

# Reward model: a sequence-classification folder (its head is in the checkpoint).
path = MODELS["reward"]
new = _frozen(path, "score", config(path), dims).module
old = old_way(load_reward_model(path), "float32")
record["reward"] = compare(new, old)
record["reward"]["score_equal"] = torch.equal(gathered(new)["score.weight"], gathered(old)["score.weight"])

# LoRA actor: base weights from the checkpoint, A and B new (B = 0, so outputs equal the base model's).
path = MODELS["qwen2"]
new = _actor(config(path, lora=LORA["rank"]), dims).module
old = old_way(apply_lora(load_causal_lm(path), **LORA), "float32")
record["lora"] = compare(new, old)
record["lora"]["new_params"] = new_params(new, seed=7)
record["lora"]["trainable_equal"] = ([n for n, p in new.named_parameters() if p.requires_grad]
                                     == [n for n, p in old.named_parameters() if p.requires_grad])

# A frozen model stored in bf16 (frozen_dtype auto, model.dtype bf16) computes what fp32 shards cast to bf16 do.
path = MODELS["qwen2"]
new = _frozen(path, "lm", config(path, dtype="bfloat16"), dims).module
old = old_way(load_causal_lm(path), "bfloat16")
record["frozen_bf16"] = {"dtypes": sorted({str(p.dtype) for p in new.parameters()}),
                         "outputs_equal": torch.equal(outputs(new), outputs(old))}

if dist.get_rank() == 0:
    with open(os.environ["HR_TEST_OUT"], "w") as f:
        json.dump(record, f)
dist.barrier()
dist.destroy_process_group()
