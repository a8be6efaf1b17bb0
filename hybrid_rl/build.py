"""Config -> components. Wiring only: every decision lives in the component it configures.

The order matters for users: everything that can be checked cheaply (model folder, architecture,
TP size, datasets, reward functions) is checked before any weight is loaded, so a bad input fails
in seconds with a message that names it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
import shutil
import socket
import sys
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from hybrid_rl.colocated.hybrid import HybridEngine, SwitchOptions
from hybrid_rl.colocated.lora_sync import AdapterSync
from hybrid_rl.colocated.multi_turn import MultiTurnRollout
from hybrid_rl.colocated.sampler import Sampler
from hybrid_rl.colocated.vllm_engine import EngineSpec, VLLMEngine
from hybrid_rl.config import Config, ConfigError, resolve_rollout
from hybrid_rl.data import PromptLoader, load_prompt_dataset
from hybrid_rl.distributed.collectives import all_reduce_min, broadcast_object
from hybrid_rl.distributed.fsdp import is_sharded, shard_model
from hybrid_rl.distributed.mesh import ParallelDims, device, fsdp_mesh, init_distributed
from hybrid_rl.distributed.offload import OffloadManager
from hybrid_rl.model.handle import Model
from hybrid_rl.model.loading import DTYPES, empty_model, enable_activation_checkpointing, load_config, load_tokenizer
from hybrid_rl.model.lora import BaseWeights, LoraWeights, apply_lora, is_lora
from hybrid_rl.model.materialize import materialize
from hybrid_rl.model.optimizers import build_optimizer
from hybrid_rl.plan_inputs import detect_device, plan_for, training_records
from hybrid_rl.planner.result import MemoryPlan
from hybrid_rl.planner.table import render, verdict
from hybrid_rl.planner.vllm_memory import measured_share, plan_sync_reserve
from hybrid_rl.rewards import RewardPool, Rubric, RubricItem, resolve_reward
from hybrid_rl.rollout.agentic import AgentSetup
from hybrid_rl.rollout.base import RolloutWorker
from hybrid_rl.rollout.chat_template import TemplateError, TemplateFamily, ToolSuffix, family_of, with_tools
from hybrid_rl.rollout.multi_turn import ToolLoop, TurnLimits
from hybrid_rl.rollout.sampling import SamplingSettings
from hybrid_rl.rollout.tool_calls import get_parser
from hybrid_rl.rollout.tools import EnvironmentReward, ToolRunner, load_environment, resolve_tools
from hybrid_rl.sidecar.agent import AgentSidecar
from hybrid_rl.sidecar.black_box import load_agent
from hybrid_rl.sidecar.checkpoint_engine import CheckpointEngine, PushOptions
from hybrid_rl.sidecar.completions import CompletionClient
from hybrid_rl.sidecar.etcd import Etcd, EtcdUnavailable, Registration
from hybrid_rl.sidecar.etcd_server import EtcdProcess
from hybrid_rl.sidecar.multi_turn import MultiTurnSidecar
from hybrid_rl.sidecar.pod_link import pod_link
from hybrid_rl.sidecar.rollout import SidecarOptions, SidecarRollout
from hybrid_rl.sidecar.server_adapter import AdapterPublisher
from hybrid_rl.sidecar.shm_ring import ShmSpaceError, check_space
from hybrid_rl.sidecar.sidecar_server import Sidecar
from hybrid_rl.sidecar.vllm_server import ServerError, ServerSpec, check_python, port_free
from hybrid_rl.types import Head
from hybrid_rl.utils.memory import gpus_free_bytes
from hybrid_rl.utils.schedule import lr_multiplier
from hybrid_rl.weightsync.layout import Layout, ModelDims, check_architecture
from hybrid_rl.weightsync.source import ModuleWeights

log = logging.getLogger(__name__)


@dataclass
class Components:
    cfg: Config
    dims: ParallelDims
    tokenizer: object
    actor: Model
    rollout: RolloutWorker
    train_loader: PromptLoader
    val_records: list
    rewards: RewardPool | None
    reference: Model | None
    critic: Model | None
    reward_model: Model | None
    offload: OffloadManager
    plan: MemoryPlan
    run_id: str = ""  # sidecar mode: the run's unique id (its etcd keys, weight versions; saved in checkpoints)


def check_inputs(cfg: Config, world: int) -> None:
    """Cheap checks of everything the user pointed at, before any heavy work."""
    hf = load_config(cfg.model.path)
    arch = (getattr(hf, "architectures", None) or [type(hf).__name__])[0]
    check_architecture(arch)
    resolve_rollout(cfg.rollout, "cuda" if torch.cuda.is_available() else "cpu")  # what this platform cannot do
    ROLLOUT_CHECKS[cfg.rollout.mode](cfg, world, hf)
    if uses_tools(cfg):
        agent_setup(cfg, load_tokenizer(cfg.model.path))  # tools, environment, template: fail now (workers start later)
    if cfg.rollout.agent:
        black_box_family(cfg, load_tokenizer(cfg.model.path))
    for name in (cfg.reward.model_path, cfg.critic.path):
        if name and not Path(name).is_dir():
            raise ConfigError(f"{name!r} (reward.model_path / critic.path) is not a model folder")


def build(cfg: Config) -> Components:
    dims = init_distributed(cfg.rollout.tp if cfg.rollout.mode == "colocated" else 1)
    _seed_everything(cfg.trainer.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer in model.path={cfg.model.path!r} has no EOS token: generation cannot stop")
    # With tools, prompts are rendered with their schemas (the chat template's `tools=`), as the model will see them.
    loader, val_records = _datasets(cfg, with_tools(tokenizer, tool_schemas(cfg)) if uses_tools(cfg) else tokenizer)
    plan = _check_memory(cfg, dims, [len(r.prompt_ids) for r in loader.dataset])
    rewards = None if cfg.algorithm.offline_pairs else _rewards(cfg)

    actor = _actor(cfg, dims)
    offload = OffloadManager(cfg.offload.dir or Path(cfg.trainer.output_dir) / "offload", rank=dims.rank)
    rollout = ROLLOUT_MODES[cfg.rollout.mode](cfg, dims, actor, offload, tokenizer, plan)
    a = cfg.algorithm
    # With LoRA the reference is the actor's own frozen base (adapter disabled): no second copy.
    reference = _frozen(cfg.model.path, "lm", cfg, dims) if a.use_reference and not cfg.model.lora.rank else None
    critic = _critic(cfg, dims) if a.use_critic else None
    if critic is not None:  # its optimizer state, once created, stays on the device through rollouts unless offloaded
        rollout.keep_room_for(critic.optimizer, cfg.offload.critic)
    rm = _frozen(cfg.reward.model_path, "score", cfg, dims) if cfg.reward.model_path else None
    return Components(cfg, dims, tokenizer, actor, rollout, loader, val_records, rewards, reference, critic, rm,
                      offload, plan, run_id=rollout.run_id if isinstance(rollout, SidecarRollout) else "")


def _check_memory(cfg: Config, dims: ParallelDims, prompt_lengths: list[int]) -> MemoryPlan:
    """The memory plan of this run, printed (rank 0) before any weight loads; one that does not fit stops here."""
    device = detect_device(local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", dims.world)))
    # Every rank plans for the smallest budget any rank sees (host memory available differs by the moment it is
    # read), so that all reach the same verdict: one rank stopping alone would leave the others waiting.
    device = dataclasses.replace(device, total_bytes=int(all_reduce_min([float(device.total_bytes)])[0]))
    plan = plan_for(cfg, dims.world, device=device, prompt_lengths=prompt_lengths)
    if dims.is_main:
        print(render(plan), flush=True)
    if not plan.fits and cfg.trainer.memory_check == "error":
        raise ConfigError(f"the memory plan above does not fit (trainer.memory_check=error): {verdict(plan)}\n"
                          "Apply the settings it lists, or start anyway with trainer.memory_check=warn.")
    return plan


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _datasets(cfg: Config, tokenizer):
    d = cfg.data
    train = training_records(cfg, tokenizer)
    if len(train) < d.prompts_per_step:
        raise ConfigError(f"data.prompts_per_step={d.prompts_per_step} is more than the {len(train)} usable rows of "
                          f"data.train_files (after dropping over-long prompts); lower it or add data")
    loader = PromptLoader(train, d.prompts_per_step, seed=cfg.trainer.seed, shuffle=d.shuffle)
    val = []
    if d.val_files:
        val = list(load_prompt_dataset(d.val_files, tokenizer, max_prompt_tokens=d.max_prompt_tokens,
                                       prompt_key=d.prompt_key, apply_chat_template=d.apply_chat_template))
        val = val[: d.val_prompts] if d.val_prompts else val
    return loader, val


def _rewards(cfg: Config) -> RewardPool:
    r = cfg.reward
    specs = [(r.fn, 1.0, "")] if r.fn else [(f.name, f.weight, f.pattern) for f in r.fns]
    items = []
    for name, weight, pattern in specs:
        fn = resolve_reward(name, pattern=pattern) if name == "format" else resolve_reward(name)
        items.append(RubricItem(name.rsplit(":", 1)[-1], fn, weight))
    if cfg.rollout.environment and load_environment(cfg.rollout.environment).has_reward:
        items.append(RubricItem("environment", EnvironmentReward(), 1.0))  # the environment's reward(), weight 1
    if cfg.rollout.agent:
        items.append(RubricItem("agent", EnvironmentReward(), 1.0))  # what the agent returned (0 for None), weight 1
    return RewardPool(Rubric(items), r.num_workers, timeout_s=r.timeout_s)


def _scheduler(opt, cfg: Config, warmup: int):
    f = lr_multiplier(warmup_steps=warmup, total_steps=cfg.trainer.total_steps, schedule=cfg.optim.schedule,
                      min_ratio=cfg.optim.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(opt, f)


def _shard(module: torch.nn.Module, path: str, cfg: Config, dims: ParallelDims) -> torch.nn.Module:
    """Shard a meta-device model, then fill this rank's shards from the checkpoint (never the whole model)."""
    shard_model(module, fsdp_mesh(dims), param_dtype=DTYPES[cfg.model.dtype])
    materialize(module, path, device=device(), seed=cfg.trainer.seed)
    return module


def _actor(cfg: Config, dims: ParallelDims) -> Model:
    module = empty_model(cfg.model.path, "lm")
    if cfg.model.activation_checkpointing:
        enable_activation_checkpointing(module)
    module.config.use_cache = False
    lora = cfg.model.lora
    if lora.rank:
        module = apply_lora(module, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                            target_modules=lora.target_modules)
        _store_frozen_in(module, DTYPES[cfg.model.frozen_storage_dtype])
    _shard(module, cfg.model.path, cfg, dims)
    o = cfg.optim
    trainable = [p for p in module.parameters() if p.requires_grad]
    opt = build_optimizer(o.name, trainable, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    return Model(module, opt, _scheduler(opt, cfg, o.warmup_steps))


def _store_frozen_in(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """A LoRA actor's frozen base is stored like the frozen models (`model.frozen_dtype`); the adapters keep
    float32 master weights. (FSDP2 wants one dtype among a unit's trainable parameters only.)"""
    for p in module.parameters():
        if not p.requires_grad:
            p.data = p.data.to(dtype)


def _critic(cfg: Config, dims: ParallelDims) -> Model:
    path = cfg.critic.path or cfg.model.path
    module = empty_model(path, "value")
    if cfg.model.activation_checkpointing:  # the critic's update keeps as many activations as the actor's, less logits
        enable_activation_checkpointing(module)
    module.config.use_cache = False
    _shard(module, path, cfg, dims)
    opt = build_optimizer(cfg.optim.name, module.parameters(), lr=cfg.critic.lr, betas=cfg.optim.betas,
                          weight_decay=0.01)  # torch AdamW's default, which the critic has always used
    return Model(module, opt, _scheduler(opt, cfg, cfg.critic.warmup_steps))


def _frozen(path: str, head: Head, cfg: Config, dims: ParallelDims) -> Model:
    """Reference or reward model: no gradients; its shards stored in `model.frozen_dtype`."""
    module = empty_model(path, head, dtype=DTYPES[cfg.model.frozen_storage_dtype])
    module.requires_grad_(False)
    return Model(_shard(module, path, cfg, dims))


def sampling_settings(cfg: Config) -> SamplingSettings:
    r = cfg.rollout
    return SamplingSettings(r.max_new_tokens, r.temperature, r.top_p, r.top_k)


def _colocated(cfg: Config, dims: ParallelDims, actor: Model, offload: OffloadManager, tokenizer,
               plan: MemoryPlan) -> Sampler | MultiTurnRollout:
    """The hybrid engine: vLLM in-process on the training ranks; with tools, driven turn by turn."""
    sampler = Sampler(_engine(cfg, dims, actor, offload, plan), tokenizer, dims, sampling_settings(cfg),
                      seed=cfg.trainer.seed)
    return MultiTurnRollout(sampler, tokenizer, agent_setup(cfg, tokenizer)) if uses_tools(cfg) else sampler


def uses_tools(cfg: Config) -> bool:
    return bool(cfg.rollout.tools or cfg.rollout.environment)


def tool_schemas(cfg: Config) -> list[dict]:
    env = load_environment(cfg.rollout.environment) if cfg.rollout.environment else None
    return [t.schema for t in resolve_tools(list(cfg.rollout.tools))] + (list(env.schemas) if env else [])


def agent_setup(cfg: Config, tokenizer) -> AgentSetup:
    """The tools, environment and chat-template rules of a multi-turn run (ConfigError for any bad one). The tool
    workers start at the first call."""
    r, m = cfg.rollout, cfg.rollout.multi_turn
    try:
        tools = resolve_tools(list(r.tools))
        env = load_environment(r.environment) if r.environment else None
        family = family_of(m.template, getattr(tokenizer, "chat_template", None))
        schemas = [t.schema for t in tools] + (list(env.schemas) if env else [])
        suffix = ToolSuffix(tokenizer, family, schemas)
        parser = get_parser(family.parser if m.parser == "auto" else m.parser)
    except (ValueError, TemplateError) as e:
        raise ConfigError(str(e)) from None
    runner = ToolRunner(tools, env.methods if env else (), workers=m.tool_workers,
                        timeout_s=m.tool_timeout_s, max_chars=m.max_tool_response_tokens * 16)
    limits = TurnLimits(m.max_turns, m.max_tool_calls, m.max_tool_response_tokens, r.max_new_tokens, m.max_turn_tokens)
    return AgentSetup(ToolLoop(tokenizer, suffix, parser, runner, limits), runner, suffix, env,
                      cfg.data.max_prompt_tokens)


def black_box_family(cfg: Config, tokenizer) -> TemplateFamily:
    """A black-box agent run's chat-template family (its suffix rule), checked with the agent's import path."""
    try:
        load_agent(cfg.rollout.agent)
        family = family_of(cfg.rollout.multi_turn.template, getattr(tokenizer, "chat_template", None))
        ToolSuffix(tokenizer, family)
    except (ValueError, TemplateError) as e:
        raise ConfigError(str(e)) from None
    return family


def _check_colocated(cfg: Config, world: int, hf_config) -> None:
    ParallelDims(world, 0, 0, cfg.rollout.tp)


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


def sidecar_namespace(cfg: Config, pod: int, server: int = 0, run_id: str = "") -> str:
    """A server's shared-memory namespace: unique per run (etcd endpoint, prefix and run id), pod and server."""
    digest = hashlib.sha1(f"{cfg.sidecar.etcd}{sidecar_prefix(cfg)}".encode()).hexdigest()[:10]
    return f"hrl-{digest}-{run_id}-pod{pod}" + (f"-s{server}" if server else "")


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


def _check_sidecar(cfg: Config, world: int, hf_config) -> None:
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


def _sidecar(cfg: Config, dims: ParallelDims, actor: Model, offload: OffloadManager, tokenizer,
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
                           groups=servers, host=sc.host if node == 0 else socket.getfqdn())
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
    engine = CheckpointEngine(rank=dims.rank, world=dims.world, layout=layout,
                              namespace=sidecar_namespace(cfg, 0, index, run_id), options=options, device=device(),
                              dtype=DTYPES[r.dtype], server=(lambda: sidecar.server) if sidecar is not None else None,
                              link=link, servers=servers, local_world=local_world)
    o = cfg.offload
    # Asynchronous runs generate while the trainer trains: the server never sleeps (give it its own GPUs).
    total_servers = servers * (dims.world // local_world) + sc.pods - 1
    opts = SidecarOptions(o.actor_params, o.actor_grads, o.actor_optim, sc.max_restarts, sc.sleep_level,
                          sleep=d.release == "sleep" and r.max_staleness == 0, max_inflight=sc.max_inflight,
                          max_num_seqs=sc.max_num_seqs, request_tokens=r.max_model_len or cfg.data.max_prompt_tokens + r.max_new_tokens,
                          servers=total_servers)
    weights = LoraWeights(actor.module) if is_lora(actor.module) else ModuleWeights(actor.module)
    adapter = None
    if adapter_sync(cfg):  # the base once, then the adapter alone at each update (`sidecar/server_adapter.py`)
        weights = BaseWeights(actor.module)
        adapter = AdapterPublisher(actor.module, Path(cfg.trainer.output_dir) / "adapter_sync", index=index,
                                   dtype=DTYPES[r.dtype], keep=adapter_versions(cfg) + 1)
    inflight = max_inflight(cfg, dims.world, total_servers)  # until the servers' KV capacity is read
    return SidecarRollout(policy=actor.module, optimizer=actor.optimizer, dims=dims, weights=weights, engine=engine,
                          sidecar=sidecar, etcd=etcd,
                          client=CompletionClient(max_inflight=inflight, progress_timeout_s=sc.progress_timeout_s),
                          stream=CompletionClient(max_inflight=inflight, progress_timeout_s=sc.progress_timeout_s),
                          offload=offload, options=opts, tokenizer=tokenizer, settings=sampling_settings(cfg),
                          seed=cfg.trainer.seed, sharded=any(is_sharded(p) for p in actor.module.parameters()),
                          private_etcd=private_etcd, run_id=run_id, announcement=announcement, adapter=adapter,
                          adapter_timeout_s=sc.update_timeout_s)


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
                host: str | None = None) -> ServerSpec:
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
                      max_lora_rank=cfg.model.lora.rank if adapter_sync(cfg) else 0, max_loras=adapter_versions(cfg))


def adapter_sync(cfg: Config) -> bool:
    """A LoRA actor whose adapter goes to vLLM by itself (`model.lora.sync=adapter`)."""
    return cfg.model.lora.rank > 0 and cfg.model.lora.sync == "adapter"


def adapter_versions(cfg: Config) -> int:
    """Adapter versions a sidecar server may have in flight at once: the current one and, in asynchronous runs,
    those of requests sent up to `rollout.max_staleness` updates ago."""
    return cfg.rollout.max_staleness + 1


# rollout.mode -> builder of the rollout worker (one signature: cfg, dims, actor, offload, tokenizer, plan)
ROLLOUT_MODES = {"colocated": _colocated, "sidecar": _sidecar}
# rollout.mode -> its cheap start-up checks (cfg, world, the model's HF config), run before any weight is loaded
ROLLOUT_CHECKS = {"colocated": _check_colocated, "sidecar": _check_sidecar}


def _engine(cfg: Config, dims: ParallelDims, actor: Model, offload: OffloadManager, plan: MemoryPlan) -> HybridEngine:
    r = cfg.rollout
    d = resolve_rollout(r, "cuda" if torch.cuda.is_available() else "cpu")  # as the memory planner resolves it
    adapter_on = adapter_sync(cfg)
    bucket_bytes = int(r.bucket_mb * 2**20)
    spec = EngineSpec(model_path=cfg.model.path, tp=r.tp, dtype=r.dtype,
                      max_model_len=r.max_model_len or cfg.data.max_prompt_tokens + r.max_new_tokens,
                      seed=cfg.trainer.seed, enforce_eager=d.enforce_eager,
                      gpu_memory_utilization=d.gpu_memory_utilization,
                      sync_reserve_bytes=plan_sync_reserve(plan.inputs), kv_cache_gb=d.kv_cache_gb,
                      sleep_mode=d.release == "sleep", shm_ledger_dir=str(Path(cfg.trainer.output_dir) / "vllm_shm"),
                      max_lora_rank=cfg.model.lora.rank if adapter_on else 0,
                      cpu_packed_linears=r.cpu_packed_linears)
    o = cfg.offload
    options = SwitchOptions(bucket_bytes=bucket_bytes, verify=r.verify, probe_cols=r.verify_probe_cols,
                            release=d.release, offload_params=o.actor_params, offload_grads=o.actor_grads,
                            offload_optim=o.actor_optim)
    layout = Layout(ModelDims.from_hf_config(actor.module.config), r.tp)
    weights, adapter = (LoraWeights(actor.module) if is_lora(actor.module) else None), None
    if adapter_on:
        weights = BaseWeights(actor.module)
        adapter = AdapterSync(actor.module, Path(cfg.trainer.output_dir) / "adapter_sync", rank=dims.rank,
                              dtype=DTYPES[r.dtype])
    return HybridEngine(actor.module, optimizer=actor.optimizer, dims=dims, vllm=VLLMEngine(spec), layout=layout,
                        offload=offload, options=options, device=device(), sync_dtype=DTYPES[r.dtype],
                        weights=weights, adapter=adapter)
