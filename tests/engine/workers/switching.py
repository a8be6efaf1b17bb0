"""Mode switching under torchrun: offload exactness, verification, restart, memory.

Two policies (same seed) share one vLLM engine: one offloads its train state to disk at every
switch, the other keeps it resident. Checks, written as JSON to $HR_TEST_OUT:
* offload round trip is bitwise exact and frees host memory while on disk;
* training with offload gives bitwise the same losses as without;
* the sync's extra peak memory stays within ~ two buckets + two layers;
* a corrupted bucket is caught by verification (and the engine stays usable);
* many mode switches leak no memory.
"""

import argparse

import torch
import torch.distributed as dist
from common import build, log, write_result

from hybrid_rl.distributed.offload import optimizer_tensors, param_tensors, release_freed_memory
from hybrid_rl.model.logprobs import forward_logprobs
from hybrid_rl.types import Sampling
from hybrid_rl.utils import memory
from hybrid_rl.weightsync.reshard import WeightSyncError, stream_slices

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--tp", type=int, default=1)
p.add_argument("--switches", type=int, default=20)
p.add_argument("--bucket-mb", type=float, default=1.0)
a = p.parse_args()

PROMPTS = [[58, 382, 266, 224, 20, 21], [30, 31, 32], [100, 200, 300, 40, 41], [7, 8, 9, 10]]


def rl_step(engine, model, opt, dims, step: int) -> float:
    """Sample from vLLM, then a REINFORCE-like update on the samples; returns the loss (identical on all ranks)."""
    with engine.rollout_mode():
        groups = engine.generate(PROMPTS, Sampling(max_tokens=8, temperature=1.0, n=2),
                                 seeds=[100 * step + 10 * dims.dp_rank + i for i in range(len(PROMPTS))])
    loss = torch.zeros(())
    for i, group in enumerate(groups):
        for gen in group:
            ids = torch.tensor([PROMPTS[i] + list(gen.token_ids)])
            lp = forward_logprobs(model, ids, torch.arange(ids.shape[1])[None], torch.roll(ids, -1, 1))
            loss = loss - lp[0, len(PROMPTS[i]) - 1 : -1].mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def snapshot(model, opt):
    return [t.clone() for t in param_tensors(model) + optimizer_tensors(opt)]


result = {}
disk, m_disk, o_disk, dims = build(a.model, tp=a.tp, offload="disk", bucket_mb=a.bucket_mb)
resident, m_res, o_res, _ = build(a.model, tp=a.tp, offload="none", bucket_mb=a.bucket_mb, vllm=disk.vllm)

# 1. Bitwise-equal training with and without offload.
losses_disk = [rl_step(disk, m_disk, o_disk, dims, s) for s in range(3)]
losses_res = [rl_step(resident, m_res, o_res, dims, s) for s in range(3)]
result["losses_disk"], result["losses_resident"] = losses_disk, losses_res
log("losses", losses_disk, losses_res)

# 2. Offload round trip: exact, and RSS falls while the state is on disk.
before = snapshot(m_disk, o_disk)
state_bytes = sum(t.untyped_storage().nbytes() for t in param_tensors(m_disk) + optimizer_tensors(o_disk))
release_freed_memory()
rss0 = memory.rss_bytes()
freed = disk.offload.offload("t.params", param_tensors(m_disk), "disk")
freed += disk.offload.offload("t.optim", optimizer_tensors(o_disk), "disk")
rss1 = memory.rss_bytes()
disk.offload.reload("t.params")
disk.offload.reload("t.optim")
after = snapshot(m_disk, o_disk)
result["offload_exact"] = all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
result["offload_bytes"], result["offload_rss_drop"], result["state_bytes"] = freed, rss0 - rss1, state_bytes

# 3. Extra peak memory of one sync (second sync onwards: the plan is cached): the resharder alone
# (stream consumed without loading), then the whole sync including vLLM's CPU reload path.
release_freed_memory()
memory.reset_peak_rss()
rss_before = memory.rss_bytes()
for _ in stream_slices(next(iter(resident._plans.values())), resident._sources(), device=resident.device,
                       probe_cols=64):
    pass
result["sync_stream_peak_extra"] = memory.peak_rss_bytes() - rss_before
release_freed_memory()
memory.reset_peak_rss()
rss_before = memory.rss_bytes()
with resident.rollout_mode():
    pass
result["sync_peak_extra"] = memory.peak_rss_bytes() - rss_before
result["sync_buffer_peak"] = resident.report.peak_buffer_bytes
result["bucket_bytes"] = resident.options.bucket_bytes
result["sync_bytes_received"] = resident.report.bytes_received
result["model_bytes_fp32"] = sum(t.numel() * 4 for t in m_res.state_dict().values())

# 4. A weight corrupted in flight (between the all-to-all and vLLM) on the last rank only is caught, and every rank
# stops with the same error at about the same moment (its TP partner must not go on into vLLM's next all-reduce);
# the engine stays usable afterwards.
import time  # noqa: E402

load_weights = resident.vllm.load_weights
BAD_RANK = dims.world - 1


def corrupt_second_slice(stream, path):
    def corrupted(buckets):  # the resharder's buckets (lists of slices): the second slice of the first one
        for k, items in enumerate(buckets):
            if k == 0:
                ts, t = items[1]
                items[1] = ts, t.mul_(1.001)
            yield items

    load_weights(corrupted(stream), path)


if dims.rank == BAD_RANK:
    resident.vllm.load_weights = corrupt_second_slice
try:
    with resident.rollout_mode():
        pass
    result["corruption_caught"] = False
    message = None
except WeightSyncError as e:
    result["corruption_caught"] = True
    message = str(e)
raised_at = time.time()
resident.vllm.load_weights = load_weights
seen = [None] * dims.world
dist.all_gather_object(seen, (message, raised_at))
result["corruption_messages"] = [m for m, _ in seen]
result["corruption_spread_s"] = max(t for _, t in seen) - min(t for _, t in seen)
result["corruption_message"] = message
result["bad_rank"] = BAD_RANK
result["mode_after_error"] = resident.mode.value
with resident.rollout_mode():
    resident.generate(PROMPTS[:1], Sampling(max_tokens=2), seeds=[0])

# 5. Many switches: memory stays flat.
rss = []
for _ in range(a.switches):
    with disk.rollout_mode():
        disk.generate(PROMPTS, Sampling(max_tokens=4), seeds=[0, 1, 2, 3])
    rss.append(memory.rss_bytes())
result["rss_after_switches"] = rss
result["switch_seconds"] = disk.report.seconds

# Everything must hold on every rank: AND the booleans over ranks.
for key in ("offload_exact", "corruption_caught"):
    t = torch.tensor([float(result[key])])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    result[key] = bool(t.item())
write_result(result)
disk.close()
dist.destroy_process_group()
