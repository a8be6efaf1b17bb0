"""A tiny Qwen3-MoE built the trainer's way (meta device, FSDP2 over 2 ranks, each rank reads only its experts'
per-expert checkpoint tensors and fuses them) against `from_pretrained` (transformers' own fusing) + shard; then
exported with `export_hf` and loaded back by plain transformers. Run under torchrun; rank 0 writes $HR_TEST_OUT."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hybrid_rl.checkpoint.hf_export import export_hf  # noqa: E402
from hybrid_rl.distributed.fsdp import local_rows, shard_model  # noqa: E402
from hybrid_rl.distributed.mesh import fsdp_mesh, init_distributed  # noqa: E402
from hybrid_rl.model.loading import empty_model, load_causal_lm, load_tokenizer  # noqa: E402
from hybrid_rl.model.materialize import materialize  # noqa: E402
from hybrid_rl.model.weight_files import WeightFiles  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--models", nargs="+", required=True)
p.add_argument("--out", required=True)
a = p.parse_args()
dims = init_distributed(1)
IDS = torch.tensor([[5, 17, 200, 33, 8, 90, 41, 7, 300, 12, 64, 3], [9, 9, 120, 77, 2, 51, 18, 250, 6, 44, 100, 1]])


def gathered(module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in module.named_parameters()}


@torch.no_grad()
def logprobs(module) -> torch.Tensor:
    return module(input_ids=IDS).logits.float().log_softmax(-1)


def check(path: str) -> dict:
    new = shard_model(empty_model(path, "lm"), fsdp_mesh(dims), param_dtype=torch.float32)
    report = materialize(new, path, device="cpu", chunk_bytes=4096)
    old = shard_model(load_causal_lm(path), fsdp_mesh(dims), param_dtype=torch.float32)
    gn, go = gathered(new), gathered(old)
    reference = logprobs(old)  # every rank: a forward of the sharded model is collective
    files = WeightFiles(path)
    experts = new.config.num_experts
    fused = {n: p for n, p in new.named_parameters() if n.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3}
    mine = sum(b - a for a, b in (local_rows(p) for p in fused.values()))
    expert_bytes = sum(files.row_bytes(k) * files.shape(k)[0] for k in files.file_of if ".experts." in k)
    other_bytes = sum(p.numel() * 4 for n, p in new.named_parameters() if n not in fused)
    out = {
        "names_equal": sorted(gn) == sorted(go), "params": len(go),
        "unequal": [n for n in go if not torch.equal(gn[n], go[n])],
        "outputs_equal": torch.equal(logprobs(new), reference),
        "fused": sorted(fused), "experts_held": mine, "experts_total": experts * len(fused),
        "expert_bytes_file": expert_bytes, "bytes_read": report.bytes_read, "other_bytes": other_bytes,
        "largest_read": report.largest_read,
        "tied": new.lm_head.weight is new.model.embed_tokens.weight,
    }
    # Export with the project's exporter; plain transformers loads it back, with the per-expert names on disk.
    dest = Path(a.out) / Path(path).name
    export_hf(new, load_tokenizer(path), dest, rank=dims.rank)
    dist.barrier()
    if dims.rank == 0:
        from transformers import AutoModelForCausalLM

        back = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)
        ref = {n: t for n, t in gn.items()}
        out["export_equal"] = all(torch.equal(t, ref[n]) for n, t in back.named_parameters())
        out["export_keys_equal"] = sorted(WeightFiles(dest).file_of) == sorted(files.file_of)
        out["export_outputs_equal"] = torch.equal(logprobs(back), reference)
    return out


record = {Path(m).name: check(m) for m in a.models}
if dist.get_rank() == 0:
    Path(os.environ["HR_TEST_OUT"]).write_text(json.dumps(record, indent=1))
dist.destroy_process_group()
