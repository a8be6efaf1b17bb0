"""FSDP2 on gloo with `gloo_comms`' pairwise collectives and `shm_comms`' shared memory against gloo's own, run
under torchrun (3 ranks).

Rank 0 writes a JSON record to $HR_TEST_OUT: the collectives alone on integer-valued tensors (sums
exact in any order, so bitwise comparable), and two training steps of the tiny model sharded three ways
(`shard_model` installs the shared-memory comms on CPU, or the pairwise ones with `shared_memory=False`; the
reference model is sharded with gloo's own).
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
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hybrid_rl.distributed import gloo_comms, shm_comms  # noqa: E402
from hybrid_rl.distributed.fsdp import shard_model, transformer_blocks  # noqa: E402
from hybrid_rl.distributed.mesh import fsdp_mesh, init_distributed  # noqa: E402
from hybrid_rl.utils.shm import SHM_DIR  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
a = p.parse_args()
dims = init_distributed(1)
rank, world = dist.get_rank(), dist.get_world_size()
group = dist.group.WORLD
record: dict = {"world": world}

# The collectives alone: 7 elements a rank's chunk (odd, so no alignment is assumed), integer values.
for dtype in (torch.float32, torch.bfloat16):
    name = str(dtype).split(".")[-1]
    g = torch.Generator().manual_seed(rank)
    full = torch.randint(-50, 50, (world * 7,), generator=g).to(dtype)
    ours, theirs = torch.empty(7, dtype=dtype), torch.empty(7, dtype=dtype)
    gloo_comms.PairwiseReduceScatter()(ours, full.clone(), group)
    dist.reduce_scatter_tensor(theirs, full.clone())
    record[f"reduce_scatter_{name}"] = torch.equal(ours, theirs)
    out_ours, out_theirs = torch.empty(world * 7, dtype=dtype), torch.empty(world * 7, dtype=dtype)
    out_ours[rank * 7:(rank + 1) * 7] = full[:7]
    gloo_comms.PairwiseAllGather()(out_ours, out_ours[rank * 7:(rank + 1) * 7], group)  # FSDP2's in-place slot
    dist.all_gather_into_tensor(out_theirs, full[:7].clone())
    gathered_apart = torch.empty(world * 7, dtype=dtype)
    gloo_comms.PairwiseAllGather()(gathered_apart, full[:7].clone(), group)  # an input outside the output
    record[f"all_gather_{name}"] = torch.equal(out_ours, out_theirs) and torch.equal(gathered_apart, out_theirs)
try:
    gloo_comms.PairwiseReduceScatter()(ours, full, group, op=dist.ReduceOp.AVG)
    record["avg_refused"] = False
except ValueError:
    record["avg_refused"] = True


def sharded(comms: str, shard: int = 0) -> torch.nn.Module:
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    mesh = fsdp_mesh(dataclasses.replace(dims, shard=shard))
    if comms != "gloo":
        return shard_model(m, mesh, param_dtype=torch.bfloat16, shared_memory=comms == "shm")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in [*transformer_blocks(m), m]:
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=shard != 1)
    return m


# HSDP at shard size 1 ("whole"): every weight whole on every rank, gradients all-reduced by gloo in both.
models = {"shm": sharded("shm"), "pairwise": sharded("pairwise"), "gloo": sharded("gloo"),
          "whole": sharded("shm", shard=1), "whole_gloo": sharded("gloo", shard=1)}


def installed(model, gather, reduce) -> bool:
    return all(isinstance(g._all_gather_comm, gather) and isinstance(g._reduce_scatter_comm, reduce)
               for mod in model.modules() if isinstance(mod, FSDPModule) for g in mod._get_fsdp_state()._fsdp_param_groups)


record["installed"] = installed(models["pairwise"], gloo_comms.PairwiseAllGather, gloo_comms.PairwiseReduceScatter)
record["installed_shm"] = installed(models["shm"], shm_comms.ShmAllGather, shm_comms.ShmReduceScatter)
record["installed_whole"] = installed(models["whole"], gloo_comms.PairwiseAllGather, gloo_comms.OneRankReduceScatter)
ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(100 + rank))  # each rank its own data
logits, losses = {}, {}
for name, m in models.items():
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for step in range(2):
        out = m(input_ids=ids, labels=ids)
        if step == 0:
            logits[name] = out.logits.detach().float()
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    losses[name] = float(out.loss)
    m.eval()
record["first_logits_equal"] = torch.equal(logits["pairwise"], logits["gloo"])
record["first_logits_equal_shm"] = torch.equal(logits["shm"], logits["gloo"])
# The same sums in the same order: bitwise equal, with the copy FSDP2 makes at a shard group of one skipped.
record["whole_equal"] = all(torch.equal(p.full_tensor(), q.full_tensor()) for p, q in
                            zip(models["whole"].parameters(), models["whole_gloo"].parameters(), strict=True))
record["whole_losses"] = [losses["whole"], losses["whole_gloo"]]
whole = [g._reduce_scatter_comm for mod in models["whole"].modules() if isinstance(mod, FSDPModule)
         for g in mod._get_fsdp_state()._fsdp_param_groups]
record["whole_outputs_aliased"] = min(c.aliased for c in whole)
for name in ("pairwise", "shm"):
    diffs = [float((p.full_tensor() - q.full_tensor()).abs().max()) for p, q in
             zip(models[name].parameters(), models["gloo"].parameters(), strict=True)]
    record[f"max_param_diff_{name}"] = max(diffs)
moved = [float((p.full_tensor() - q).abs().max()) for p, q in
         zip(models["shm"].parameters(), AutoModelForCausalLM.from_pretrained(a.model).parameters(), strict=True)]
shm = next(g for mod in models["shm"].modules() if isinstance(mod, FSDPModule)
           for g in mod._get_fsdp_state()._fsdp_param_groups)
record.update(min_param_moved=min(moved), losses=losses, shm_used=shm._all_gather_comm.segments.uses > 0
              and shm._reduce_scatter_comm.segments.uses > 0, shm_left=[p.name for p in SHM_DIR.glob("hybrid_rl-*")])
if rank == 0:
    with open(os.environ["HR_TEST_OUT"], "w") as f:
        json.dump(record, f)
# Every rank done before any tears its connections down: without this barrier one rank of three aborted at exit
# ("terminate called without an active exception", after the record was written) in 3 of ~45 launches; 0 of 20 with it.
dist.barrier()
dist.destroy_process_group()
