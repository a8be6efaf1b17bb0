"""Two GRPO steps in sidecar mode, with faults, checking the servers' greedy generations against HF after each.

Argument: JSON {"overrides": [...], "etcd": {"dir", "port", "peer_port"}}. Rank 0 owns the etcd server's
life from the start of step 2 on (it stops and restarts it). Per step:

1. a trainer step (its session pushes the new weights to every pod's server through the checkpoint engine);
2. before step 2: the pod's own server is killed with SIGKILL, and etcd is stopped (restarted 6 s later)
   so the session must restart the server from dummy weights, wait for etcd, and bring every pod to the
   current version before generating;
3. greedy responses to fixed prompts from the servers (spread over every pod at the current version)
   against Hugging Face `generate` on the trainer's full weights (gathered from the FSDP shards).
"""

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hybrid_rl.build import build  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.dist.collectives import all_gather_object, barrier  # noqa: E402
from hybrid_rl.train import setup_logging  # noqa: E402
from hybrid_rl.trainer import Trainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from hybrid_rl.dist.etcd_server import EtcdProcess  # noqa: E402
from tests.engine.workers.common import write_result  # noqa: E402


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def greedy_check(c, trainer) -> dict:
    records = c.val_records[:4]
    with c.rollout.session():
        servers = c.rollout._current_servers() if c.dims.rank == 0 else []
        roll = c.rollout.generate(records, n=1, step=-1, group_base=0, greedy=True)
    got = {}
    for part in all_gather_object([(s.uid, s.response_ids.tolist()) for s in roll.held]):
        got.update(dict(part))
    full = get_model_state_dict(c.actor.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {"servers": servers, "vllm": [got[u] for u in range(len(records))], "version": c.rollout.version}
    if c.dims.rank == 0:
        hf = AutoModelForCausalLM.from_pretrained(c.cfg.model.path, dtype=torch.float32)
        hf.load_state_dict(full)
        stops = list(c.rollout.stop_ids)
        out["hf"] = []
        for r in records:
            g = hf.generate(torch.tensor([list(r.prompt_ids)]), max_new_tokens=c.cfg.rollout.max_new_tokens,
                            do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
            out["hf"].append(g[0, len(r.prompt_ids):].tolist())
        out["server_version"] = c.rollout.sidecar.server.weight_version()
    return out


def main() -> None:
    setup_logging()
    args = json.loads(sys.argv[1])
    captured = Captured()
    logging.getLogger("hybrid_rl").addHandler(captured)
    cfg = load_config("grpo", args["overrides"])
    c = build(cfg)
    trainer = Trainer(c)
    result = {"steps": []}
    try:
        for step in (1, 2):
            if step == 2 and c.dims.rank == 0:
                os.kill(c.rollout.sidecar.server.proc.pid, signal.SIGKILL)  # the API server; its children linger
                e = args["etcd"]
                etcd = EtcdProcess(Path(e["dir"]), e["port"], e["peer_port"])
                etcd.stop()
                threading.Timer(6.0, etcd.start).start()
                time.sleep(1.0)
            barrier()
            metrics = trainer.step(step)
            check = greedy_check(c, trainer)
            check["loss_finite"] = all(v == v for k, v in metrics.items() if k.startswith("actor/"))
            check["logprob_diff_max"] = metrics["rollout/logprob_diff_max"]
            result["steps"].append(check)
        if c.dims.rank == 0:
            result["server_starts"] = c.rollout.sidecar.server.starts
            result["warnings"] = captured.lines
    finally:
        trainer.close()
    write_result(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
