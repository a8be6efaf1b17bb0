"""Two GRPO steps in sidecar mode, with faults, checking the servers' greedy generations against HF after each.

Argument: JSON {"overrides": [...], "etcd": {"dir", "port", "peer_port"}, "faults": bool (default true),
"kill_second_server": bool (default false)}. Rank 0
owns the etcd server's life from the start of step 2 on (it stops and restarts it). Per step:

1. a trainer step (its session pushes the new weights to every pod's server through the checkpoint engine);
2. after step 1, in the next update that sends weights through the rings (the greedy check's; with a LoRA adapter
   synced as an adapter, which moves alone, step 2's, which sends the base again to the restarted server), the
   pod's own server is killed with SIGKILL between two buckets (the update is abandoned on every rank and on the
   second pod, then retried on a restarted server); before step 2: the pod's own server is killed with SIGKILL,
   and etcd is stopped (restarted 6 s later, longer than the leases' TTL, without its data: every registration
   is granted a new lease) so the session must restart the server from dummy weights, wait for etcd, and bring
   every pod to the current version before generating;
3. greedy responses to fixed prompts from the servers (spread over every pod at the current version)
   against Hugging Face `generate` on the trainer's full weights (gathered from the FSDP shards; a LoRA actor's
   merged), and the same prompts sent to each listed server on its own (every server holds the new weights),
   greedily and sampled (the sampled tokens' log-probs against HF's), with the requests each server has served
   so far (its `/metrics`) and the models it lists (its base and adapter versions).

With "kill_second_server" (a pod of two servers), after step 1 the second server is SIGKILLed in the middle of a
generation (just after the ranks listed it): the requests sent to it fail, it is restarted, the weights go to it
alone (each leader counts the updates its server was sent), and only the failed requests are sent again.
"""

import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import requests  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hybrid_rl.build import build  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.distributed.collectives import all_gather_object, barrier  # noqa: E402
from hybrid_rl.model.loading import DTYPES  # noqa: E402
from hybrid_rl.model.lora import gather_adapter, is_lora, merge_full_state_dict  # noqa: E402
from hybrid_rl.sidecar.auth import auth_headers  # noqa: E402
from hybrid_rl.sidecar.completions import CompletionClient, Router  # noqa: E402
from hybrid_rl.sidecar.vllm_server import kv_capacity_from_metrics  # noqa: E402
from hybrid_rl.train import setup_logging  # noqa: E402
from hybrid_rl.trainer import Trainer  # noqa: E402
from hybrid_rl.types import Request  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.engine.workers.common import write_result  # noqa: E402
from tests.sidecar.etcd import SharedEtcd  # noqa: E402


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def greedy_check(c, cfg, trainer) -> dict:
    records = c.val_records[:4]
    with c.rollout.session():
        servers = c.rollout._current_servers() if c.dims.rank == 0 else []
        roll = c.rollout.generate(records, n=1, step=-1, group_base=0, greedy=True)
    got = {}
    for part in all_gather_object([(s.uid, s.response_ids.tolist()) for s in roll.held]):
        got.update(dict(part))
    full = get_model_state_dict(c.actor.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {"servers": servers, "vllm": [got[u] for u in range(len(records))], "version": c.rollout.version,
           "sync_bytes": c.rollout.last_sync().bytes_per_rank}
    if is_lora(c.actor.module):  # HF's reference: the merged weights; the adapter's bytes in the rollout dtype
        out["adapter_bytes"] = sum(v.numel() * DTYPES[cfg.rollout.dtype].itemsize
                                   for v in gather_adapter(c.actor.module).values())
        full = merge_full_state_dict(c.actor.module, full)
    if c.dims.rank == 0:
        hf = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
        hf.load_state_dict(full)
        stops = list(c.rollout.stop_ids)
        out["hf"] = []
        for r in records:
            g = hf.generate(torch.tensor([list(r.prompt_ids)]), max_new_tokens=cfg.rollout.max_new_tokens,
                            do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
            out["hf"].append(g[0, len(r.prompt_ids):].tolist())
        out["server_version"] = c.rollout.sidecar.server.weight_version()
        out["served"] = {url: served(url) for url in servers}  # by the trainer's rollouts and the check above
        out["kv_tokens"] = {url: kv_capacity_from_metrics(requests.get(f"{url}/metrics", headers=auth_headers(), timeout=30).text)
                            for url in servers}
        out["own_server"] = c.rollout.sidecar.server.url
        out["models"] = {url: sorted(m["id"] for m in requests.get(f"{url}/v1/models", headers=auth_headers(), timeout=30).json()["data"])
                         for url in servers}  # the base and the adapter versions each server lists
        out["per_server"], out["per_server_logprob_diff"] = {}, {}
        client = CompletionClient(max_inflight=4, progress_timeout_s=300)
        greedy, sampled = c.rollout._sampling(greedy=True), c.rollout._sampling(greedy=False)
        for url in servers:
            router = Router()
            router.set_servers([url])
            done, failed = client.run([Request(i, list(r.prompt_ids), 0) for i, r in enumerate(records)], greedy,
                                      router, c.rollout.model_name())
            assert not failed, failed
            out["per_server"][url] = [list(done[i].token_ids) for i in range(len(records))]
            # Sampled tokens' log-probs from this server alone against HF's on the same tokens (the trainer's weights)
            done, failed = client.run([Request(i, list(r.prompt_ids), 1000 + i) for i, r in enumerate(records)],
                                      sampled, router, c.rollout.model_name())
            assert not failed, failed
            out["per_server_logprob_diff"][url] = max(
                logprob_diff(hf, list(r.prompt_ids), done[i], cfg.rollout.temperature) for i, r in enumerate(records))
        client.close()
    return out


def logprob_diff(hf, prompt: list[int], g, temperature: float) -> float:
    """The largest |server - HF| log-prob over one response's tokens (HF over the whole vocabulary at the temperature,
    as the trainer computes them)."""
    if not g.token_ids:
        return 0.0
    ids = torch.tensor([prompt + list(g.token_ids)])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
    return float((ref - torch.tensor(list(g.logprobs), dtype=ref.dtype)).abs().max())


def served(url: str) -> float:
    """Generation requests the server finished (its Prometheus counter, every finish reason)."""
    text = requests.get(f"{url}/metrics", headers=auth_headers(), timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def kill_second_server_mid_generation(c, result: dict) -> None:
    """Every rank: a generation during which the pod's second server (its leader: rank 2) dies just after the ranks
    listed it. Records the requests each rank sent and resent (`CompletionClient.run` calls)."""
    rollout, sent = c.rollout, []
    run, route = rollout.client.run, rollout._router

    def counted_run(requests_, *args):
        requests_ = list(requests_)
        sent.append(len(requests_))
        return run(requests_, *args)

    def router_then_kill():
        router = route()
        if rollout.sidecar is not None and rollout.engine.server_index == 1 and not result.get("killed_second"):
            os.killpg(rollout.sidecar.server.proc.pid, signal.SIGKILL)
            rollout.sidecar.server.proc.wait()
            result["killed_second"] = True
        return router
    rollout.client.run, rollout._router = counted_run, router_then_kill
    try:
        with rollout.session():
            roll = rollout.generate(c.val_records[:4], n=4, step=-2, group_base=0)
    finally:
        rollout.client.run, rollout._router = run, route
    result["killed_second"] = any(all_gather_object(bool(result.get("killed_second"))))  # rank 2 killed it
    result["fault_sent"] = all_gather_object(sent)
    result["fault_held"] = sum(all_gather_object(len(roll.held)))


def restart_without_data(etcd: SharedEtcd) -> None:
    shutil.rmtree(etcd.data_dir, ignore_errors=True)
    etcd.start()


def kill_between_buckets(c, result: dict) -> None:
    """Rank 0: SIGKILL its server (the whole process group) once bucket 0 of the next update has been asked for and
    before bucket 1 is: the update fails mid-way on every rank, the second pod is mid-update too."""
    http = c.rollout.engine.http
    ask = http.bucket

    def bucket(seq: int, k: int) -> None:
        if k == 1 and not result.get("killed_mid_update"):
            http.error(wait=True)  # bucket 0 landed
            os.killpg(c.rollout.sidecar.server.proc.pid, signal.SIGKILL)
            result["killed_mid_update"] = True
        ask(seq, k)
    http.bucket = bucket


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
            if step == 2 and c.dims.rank == 0 and args.get("faults", True):
                os.kill(c.rollout.sidecar.server.proc.pid, signal.SIGKILL)  # the API server; its children linger
                e = args["etcd"]
                etcd = SharedEtcd(Path(e["dir"]), e["port"], e["peer_port"])
                etcd.stop()
                # Back after 6 s, twice the leases' TTL, and without its data (a replaced etcd): etcd restores leases
                # on a plain restart, so only then do the registrations take the re-grant path.
                threading.Timer(6.0, restart_without_data, args=(etcd,)).start()
                time.sleep(1.0)
            barrier()
            metrics = trainer.step(step)
            if step == 1 and c.dims.rank == 0 and args.get("faults", True):
                kill_between_buckets(c, result)  # the update of the check below: abandoned, retried, recovered
            if step == 1 and args.get("kill_second_server"):
                kill_second_server_mid_generation(c, result)
            check = greedy_check(c, cfg, trainer)
            check["loss_finite"] = all(v == v for k, v in metrics.items() if k.startswith("actor/"))
            check["logprob_diff_max"] = metrics["rollout/logprob_diff_max"]
            check["spec"] = [metrics.get("rollout/spec_drafted", 0.0), metrics.get("rollout/spec_accepted", 0.0)]
            result["steps"].append(check)
        engine = c.rollout.engine
        pushes = all_gather_object((engine.server_index, engine.pushes) if engine.leader else None)
        result["pushes"] = {index: n for index, n in filter(None, pushes)}  # updates sent, per server of the pod
        result["max_inflight"] = c.rollout.client.max_inflight
        result["versions"] = c.rollout.versions  # weight versions pushed ("<run id>-v1" .. "-v<versions>")
        if c.dims.rank == 0:
            result["private_etcd"] = c.rollout.private_etcd.endpoint if c.rollout.private_etcd else ""
            result["server_starts"] = c.rollout.sidecar.server.starts
            result["warnings"] = captured.lines
    finally:
        trainer.close()
    write_result(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
