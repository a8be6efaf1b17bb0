"""The sidecar deployment (`rollout.mode=sidecar`): vLLM servers beside the trainer, fed by the checkpoint engine,
found in etcd. Its wiring reads the config, so it lives here in build/ rather than in `hybrid_rl/sidecar/`, which
sits below the config in the layers."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import socket
import sys
import uuid
from functools import partial
from pathlib import Path

import torch

from hybrid_rl.build.rollout import adapter_sync, agent_setup, black_box_family, sampling_settings, uses_tools
from hybrid_rl.config import Config, ConfigError, resolve_rollout, speculation
from hybrid_rl.distributed.collectives import broadcast_object
from hybrid_rl.distributed.fsdp import is_sharded, shard_size
from hybrid_rl.distributed.mesh import ParallelDims, device
from hybrid_rl.distributed.offload import OffloadManager
from hybrid_rl.model.handle import Model
from hybrid_rl.model.loading import DTYPES
from hybrid_rl.model.lora import BaseWeights, LoraWeights, is_lora
from hybrid_rl.planner.result import MemoryPlan
from hybrid_rl.planner.vllm_memory import measured_share, plan_sync_reserve
from hybrid_rl.sidecar.agent import AgentSidecar
from hybrid_rl.sidecar.auth import share_run_secret
from hybrid_rl.sidecar.black_box import load_agent
from hybrid_rl.sidecar.checkpoint_engine import CheckpointEngine, PushOptions, PushTarget, RankPlace
from hybrid_rl.sidecar.completions import CompletionClient
from hybrid_rl.sidecar.etcd import Etcd, EtcdUnavailable, Registration
from hybrid_rl.sidecar.etcd_server import EtcdProcess
from hybrid_rl.sidecar.leftovers import sweep_private_etcd
from hybrid_rl.sidecar.multi_turn import MultiTurnSidecar
from hybrid_rl.sidecar.pod_link import pod_link
from hybrid_rl.sidecar.rollout import SidecarRollout
from hybrid_rl.sidecar.rollout_parts import ServerLinks, SidecarOptions, SyncedPolicy
from hybrid_rl.sidecar.server_adapter import AdapterPublisher
from hybrid_rl.sidecar.shm_ring import ShmSpaceError, check_space
from hybrid_rl.sidecar.sidecar_server import Sidecar
from hybrid_rl.sidecar.vllm_server import ServerError, ServerSpec, check_python, port_free
from hybrid_rl.utils.memory import gpus_free_bytes
from hybrid_rl.weightsync.layout import Layout, ModelDims
from hybrid_rl.weightsync.source import ModuleWeights

log = logging.getLogger(__name__)


def sidecar_prefix(cfg: Config, run_id: str = "") -> str:
    """The etcd prefix of the runs sharing this output folder's name (`sidecar.prefix`, or one named after the
    folder); with `run_id`, the run's own prefix below it."""
    base = (cfg.sidecar.prefix or f"/hybrid_rl/{Path(cfg.trainer.output_dir).resolve().name}").rstrip("/")
    return f"{base}/{run_id}" if run_id else base


RUN_ID_FILE = "run_id"


def sidecar_run_id(cfg: Config, dims: ParallelDims) -> str:
    """This run's unique id (rank 0 reads it from the output folder, or makes and writes one there; every rank gets
    it): in every etcd key and weight version of the run, so two runs whose output folders share a name never use
    each other's servers. A resume from the same folder is the same run; the checkpoints record it too."""
    rid, error = "", ""
    if dims.rank == 0:
        path = Path(cfg.trainer.output_dir) / RUN_ID_FILE
        try:
            rid = path.read_text().strip() if path.exists() else ""
            if not rid:
                rid = uuid.uuid4().hex[:12]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(rid + "\n")
        except OSError as e:
            error = f"the run id in {path}: {e}"
    rid, error = broadcast_object((rid, error))
    if error:
        raise RuntimeError(error)
    return rid


def sidecar_namespace(cfg: Config, pod: int, server: int = 0, run_id: str = "", nonce: str = "") -> str:
    """A server's shared-memory namespace: unique per run (etcd endpoint, prefix and run id), pod and server, and
    unguessable before the launch that makes it (`nonce`: random per launch; nobody can create its files first)."""
    digest = hashlib.sha1(f"{cfg.sidecar.etcd}{sidecar_prefix(cfg)}".encode()).hexdigest()[:10]
    return f"hrl-{digest}-{run_id}-pod{pod}" + (f"-s{server}" if server else "") + (f"-{nonce}" if nonce else "")


def servers_per_node(cfg: Config, local_world: int) -> int:
    """The training pod's servers per node: `sidecar.servers_per_node` (at most one per TP group of the node's
    trainer ranks); 0 = one per TP group on GPUs (each on its own GPUs), one on CPU (servers there share the same
    cores, so a second one adds processes and memory, not throughput)."""
    groups = max(1, local_world // cfg.rollout.tp)
    n = cfg.sidecar.servers_per_node or (groups if torch.cuda.is_available() else 1)
    return min(n, groups)


def max_inflight(cfg: Config, world: int, servers: int) -> int:
    """Requests in flight per rank: `sidecar.max_inflight`, or (0) what the servers batch at once, shared out (the
    start; once the servers are up, their measured KV capacity may lower it: `SidecarRollout._size_inflight`)."""
    sc = cfg.sidecar
    return sc.max_inflight or max(1, -(-servers * sc.max_num_seqs // world))


def check(cfg: Config, world: int, hf_config) -> None:
    """Everything a sidecar run needs that can fail in seconds: TP vs heads and ranks, the server's interpreter,
    its port (on the node that starts it) and etcd."""
    sc, tp = cfg.sidecar, cfg.rollout.tp
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if tp > min(local, world):
        raise ConfigError(f"rollout.tp={tp}: the vLLM sidecar's TP size must be at most the trainer ranks of its pod "
                          f"({min(local, world)}): each server TP rank gets its weights from one trainer rank")
    try:
        Layout(ModelDims.from_hf_config(hf_config), tp)
    except ValueError as e:
        raise ConfigError(f"rollout.tp={tp} does not fit the model: {e}") from None
    try:
        check_python(sc.python or sys.executable)
    except ServerError as e:
        raise ConfigError(str(e)) from None
    if not sc.etcd:
        if sc.pods > 1 or local < world:
            raise ConfigError(f"sidecar.etcd is not set: a private etcd serves one pod on one node only (this run has "
                              f"sidecar.pods={sc.pods} and {world // max(1, local)} node(s)); start etcd where every "
                              "node reaches it and set sidecar.etcd=http://HOST:PORT")
        if shutil.which("etcd") is None:
            raise ConfigError("sidecar.etcd is not set and no etcd binary is installed to start a private one: install "
                              "etcd (Debian package etcd-server; `make install` does) or set sidecar.etcd")
    rings = servers_per_node(cfg, min(local, world)) * tp * sc.slots * int(cfg.rollout.bucket_mb * 2**20)
    try:  # the rings of this node's servers (a bucket holding a tensor larger than rollout.bucket_mb needs more)
        check_space(rings)
    except ShmSpaceError as e:
        raise ConfigError(str(e)) from None
    if int(os.environ.get("RANK", 0)) == 0:
        for port in range(sc.port, sc.port + servers_per_node(cfg, min(local, world))):
            if not port_free(sc.host, port):
                raise ConfigError(f"sidecar.port={sc.port}: port {port} (the pod's servers use sidecar.port and the "
                                  f"ports after it) is taken on {sc.host}; choose a free range")
    try:
        if sc.etcd:
            Etcd(sc.etcd, sidecar_prefix(cfg), wait_s=0).check()
    except (EtcdUnavailable, ValueError) as e:
        raise ConfigError(str(e)) from None


def _private_etcd(cfg: Config, dims: ParallelDims) -> tuple[str, EtcdProcess | None]:
    """`sidecar.etcd`, or (not given, one pod) the endpoint of a private etcd that rank 0 starts here: free ports, its
    data in the output folder, stopped with the run (and with rank 0 if it dies)."""
    if cfg.sidecar.etcd:
        return cfg.sidecar.etcd, None
    proc, error = None, ""
    if dims.rank == 0:
        data = Path(cfg.trainer.output_dir) / f"etcd-private-{os.getpid()}"
        try:
            sweep_private_etcd(data.parent)  # what a killed earlier run left
            data.parent.mkdir(parents=True, exist_ok=True)
            proc = EtcdProcess(data, die_with_parent=True)
            proc.start()
            log.info("sidecar.etcd not set: started a private etcd at %s (data in %s; stopped with the run). "
                     "Multi-pod runs set sidecar.etcd to a shared one.", proc.endpoint, data)
        except (OSError, RuntimeError) as e:
            error = f"could not start a private etcd (sidecar.etcd not set): {e}"
    endpoint, error = broadcast_object((proc.endpoint if proc else "", error))
    if error:
        raise RuntimeError(error)
    return endpoint, proc


def build(cfg: Config, dims: ParallelDims, actor: Model, offload: OffloadManager, tokenizer,
          plan: MemoryPlan) -> SidecarRollout | MultiTurnSidecar:  # AgentSidecar is a MultiTurnSidecar
    """The sidecar rollout worker; with tools, one multi-turn loop per trajectory against the servers."""
    inner = _sidecar_plain(cfg, dims, actor, offload, tokenizer, plan)
    if cfg.rollout.agent:
        return AgentSidecar(inner, tokenizer, black_box_family(cfg, tokenizer), load_agent(cfg.rollout.agent),
                            max_inflight=inner.stream.max_inflight)
    if not uses_tools(cfg):
        return inner
    # As many trajectories at once as the rank has requests in flight (`max_inflight`: 0 in config means "shared out").
    return MultiTurnSidecar(inner, tokenizer, agent_setup(cfg, tokenizer), max_inflight=inner.stream.max_inflight)


def _sidecar_plain(cfg: Config, dims: ParallelDims, actor: Model, offload: OffloadManager, tokenizer,
                   plan: MemoryPlan) -> SidecarRollout:
    """A vLLM server beside the trainer (started here by rank 0, serving after a minute), fed by the checkpoint
    engine; other pods (`python -m hybrid_rl.pod`) get each update through the pod group."""
    r, sc = cfg.rollout, cfg.sidecar
    d = resolve_rollout(r, "cuda" if torch.cuda.is_available() else "cpu")
    endpoint, private_etcd = _private_etcd(cfg, dims)
    run_id = sidecar_run_id(cfg, dims)
    nonce = share_run_secret(cfg.trainer.output_dir, rank=dims.rank, broadcast=broadcast_object)
    etcd = Etcd(endpoint, sidecar_prefix(cfg, run_id), wait_s=sc.etcd_wait_s)
    announcement = None
    if dims.rank == 0:
        log.info("sidecar run %s: etcd %s, keys under %s", run_id, endpoint, etcd.prefix)
        # `<folder prefix>/runs/<run id>`, under a lease: how rollout-only pods find the live run (`hybrid_rl.pod`)
        announcement = Registration(Etcd(endpoint, sidecar_prefix(cfg), wait_s=sc.etcd_wait_s), f"runs/{run_id}",
                                    {"run": run_id}, ttl_s=sc.lease_ttl_s)
    # One server per TP group of each node's ranks (torchrun numbers a node's ranks contiguously): local ranks
    # g*tp .. g*tp+tp-1 feed server g, whose first rank (its leader) starts, watches and drives it.
    local_world = min(int(os.environ.get("LOCAL_WORLD_SIZE", dims.world)), dims.world)
    servers = servers_per_node(cfg, local_world)
    node, local = divmod(dims.rank, local_world)
    group = local // r.tp
    index = node * servers + group  # the server's number in the pod
    sidecar = None
    if local < r.tp * servers and local % r.tp == 0:
        name = "vllm_server.log" if index == 0 else f"vllm_server.{index}.log"
        spec = server_spec(cfg, port=sc.port + group, log_path=Path(cfg.trainer.output_dir) / name, group=group,
                           groups=servers, host=sc.host if node == 0 else socket.getfqdn(),
                           namespace=sidecar_namespace(cfg, 0, index, run_id, nonce))
        cuda_auto = spec.cuda and spec.gpu_memory_utilization is None
        sidecar = Sidecar(spec, etcd, pod=0, index=index, ttl_s=sc.lease_ttl_s, start_timeout_s=sc.start_timeout_s,
                          prepare=partial(measured_utilization, reserve_bytes=plan_sync_reserve(plan.inputs),
                                          world=dims.world)
                          if cuda_auto else None)
        if not cuda_auto:
            sidecar.start(wait=False)  # it loads while the trainer builds its models; the first session waits
        # CUDA, automatic share: the first session starts it, once the trainer's models are placed, with the share
        # of the GPU then free (`measured_utilization`), as the colocated engine sizes itself.
    layout = Layout(ModelDims.from_hf_config(actor.module.config), r.tp)
    options = PushOptions(int(r.bucket_mb * 2**20), sc.slots, r.verify_probe_cols, sc.update_timeout_s)
    link = pod_link(etcd, dims, host=sc.host, tp=r.tp, pods=sc.pods, wait_s=sc.pod_wait_s,
                    op_timeout_s=sc.pod_timeout_s) if sc.pods > 1 else None
    engine = CheckpointEngine(RankPlace(dims.rank, dims.world, servers=servers, local_world=local_world),
                              PushTarget(layout, sidecar_namespace(cfg, 0, index, run_id, nonce), device=device(),
                                         dtype=DTYPES[r.dtype], link=link,
                                         server=(lambda: sidecar.server) if sidecar is not None else None),
                              options)
    o = cfg.offload
    # Asynchronous runs generate while the trainer trains: the server never sleeps (give it its own GPUs).
    total_servers = servers * (dims.world // local_world) + sc.pods - 1
    opts = SidecarOptions(o.actor_params, o.actor_grads, o.actor_optim, sc.max_restarts, sc.sleep_level,
                          sleep=d.release == "sleep" and r.max_staleness == 0, max_inflight=sc.max_inflight,
                          max_num_seqs=sc.max_num_seqs, request_tokens=r.max_model_len or cfg.data.max_prompt_tokens + r.max_new_tokens,
                          servers=total_servers, seed=cfg.trainer.seed, adapter_timeout_s=sc.update_timeout_s)
    weights = LoraWeights(actor.module) if is_lora(actor.module) else ModuleWeights(actor.module)
    adapter = None
    if adapter_sync(cfg):  # the base once, then the adapter alone at each update (`sidecar/server_adapter.py`)
        weights = BaseWeights(actor.module)
        adapter = AdapterPublisher(actor.module, Path(cfg.trainer.output_dir) / "adapter_sync", index=index,
                                   dtype=DTYPES[r.dtype], keep=adapter_versions(cfg) + 1)
    synced = SyncedPolicy(policy=actor.module, optimizer=actor.optimizer, weights=weights,
                          sharded=any(is_sharded(p) for p in actor.module.parameters()),
                          shard=shard_size(actor.module), adapter=adapter)
    inflight = max_inflight(cfg, dims.world, total_servers)  # until the servers' KV capacity is read
    links = ServerLinks(engine=engine, etcd=etcd, sidecar=sidecar,
                        client=CompletionClient(max_inflight=inflight, progress_timeout_s=sc.progress_timeout_s,
                                                vocab=actor.module.config.vocab_size),
                        stream=CompletionClient(max_inflight=inflight, progress_timeout_s=sc.progress_timeout_s,
                                                vocab=actor.module.config.vocab_size),
                        run_id=run_id, private_etcd=private_etcd, announcement=announcement)
    return SidecarRollout(synced, links, opts, sampling=sampling_settings(cfg), dims=dims, offload=offload,
                          tokenizer=tokenizer)


def run_id_of(worker) -> str:
    """The run's id, recorded in checkpoints: the plain sidecar rollout's (a multi-turn loop around it records none)."""
    return worker.run_id if isinstance(worker, SidecarRollout) else ""


def measured_utilization(spec: ServerSpec, state_to_come: int, *, reserve_bytes: int, world: int,
                         mem_get_info=None) -> ServerSpec:
    """CUDA, `rollout.gpu_memory_utilization=0` (auto): the server's `--gpu-memory-utilization`, by the colocated
    engine's rule (`planner/vllm_memory.measured_share`) applied to its TP group's GPUs as they are now (the
    trainer's models placed): the least free, less the optimizer state still to come (`state_to_come`) and NCCL's
    point-to-point connections, less `reserve_bytes` (the sync's reserve and the safety margin), at most vLLM's own
    default; without it vLLM would ask for 90% of GPUs the trainer is using. `mem_get_info(count)`: the free bytes
    of the group's GPUs and their total (`utils/memory.gpus_free_bytes`)."""
    free, total = (mem_get_info or gpus_free_bytes)(spec.tp)
    util = measured_share(free, total, state_to_come=state_to_come, world=world, reserve_bytes=reserve_bytes)
    if util <= 0:
        raise ServerError(f"rollout.gpu_memory_utilization=auto: only {min(free) / 2**30:.1f} of the GPU's "
                          f"{total / 2**30:.1f} GiB are free once the trainer's models are placed, "
                          f"{state_to_come / 2**30:.1f} GiB of it for optimizer state to come, "
                          f"{reserve_bytes / 2**30:.1f} GiB kept for the sync and the safety margin: too little for "
                          "the vLLM sidecar: offload more of the trainer (offload.*), give the servers their own GPUs, "
                          "or set rollout.gpu_memory_utilization")
    log.info("vLLM sidecar: --gpu-memory-utilization %.2f (%.1f of %.1f GiB free at its start, %.1f GiB of it for "
             "optimizer state to come)", util, min(free) / 2**30, total / 2**30, state_to_come / 2**30)
    return dataclasses.replace(spec, gpu_memory_utilization=util)


def server_spec(cfg: Config, *, port: int, log_path: Path, group: int = 0, groups: int = 1,
                host: str | None = None, namespace: str = "") -> ServerSpec:
    """A vLLM sidecar, from the rollout config (resolved for this platform): server `group` of the `groups` on its
    node, on the GPUs of its TP group (CUDA) or its share of the cores (CPU)."""
    r, sc = cfg.rollout, cfg.sidecar
    cuda = torch.cuda.is_available()
    d = resolve_rollout(r, "cuda" if cuda else "cpu")
    visible = [int(x) for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip().isdigit()]
    local = list(range(group * r.tp, (group + 1) * r.tp))
    devices = tuple(visible[i] for i in local) if len(visible) >= (group + 1) * r.tp else tuple(local)
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // groups
    cpus = tuple(cores[group * per:(group + 1) * per]) if per else tuple(cores)
    return ServerSpec(model_path=cfg.model.path, tp=r.tp, dtype=r.dtype, port=port, host=host or sc.host,
                      max_model_len=r.max_model_len or cfg.data.max_prompt_tokens + r.max_new_tokens,
                      seed=cfg.trainer.seed, enforce_eager=d.enforce_eager, log_path=str(log_path),
                      python=sc.python or sys.executable, kv_cache_gb=d.kv_cache_gb,
                      gpu_memory_utilization=d.gpu_memory_utilization, sleep_mode=d.release == "sleep", cuda=cuda,
                      max_num_seqs=sc.max_num_seqs, devices=devices if cuda and groups > 1 else (), cpus=cpus,
                      max_lora_rank=cfg.model.lora.rank if adapter_sync(cfg) else 0, max_loras=adapter_versions(cfg),
                      namespace=namespace, speculation=speculation(r))


def adapter_versions(cfg: Config) -> int:
    """Adapter versions a sidecar server may have in flight at once: the current one and, in asynchronous runs,
    those of requests sent up to `rollout.max_staleness` updates ago."""
    return cfg.rollout.max_staleness + 1
