"""The memory plan of a run's configuration: reads the models' config.json only (no weights, no data).

`plan_for(cfg, world)` turns a validated `Config` into `planner.inputs.PlanInputs` as `build.py`
would set the run up (LoRA, reference, critic, reward model, offload, rollout release) and returns
the `MemoryPlan`. Used by `python -m hybrid_rl.plan` and by the trainer, which prints the plan at
start and logs each phase's measured peak beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from hybrid_rl.algos.objectives import get_objective
from hybrid_rl.config import Config, ConfigError, resolve_rollout
from hybrid_rl.planner.estimate import choose_shard, estimate
from hybrid_rl.planner.inputs import DeviceSpec, ModelSpec, OffloadSpec, PlanInputs, RolloutSpec
from hybrid_rl.planner.param_count import ArchDims, lora_params, model_params
from hybrid_rl.planner.result import MemoryPlan
from hybrid_rl.planner.units import GIB
from hybrid_rl.types import Head
from hybrid_rl.utils import memory

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def plan_for(cfg: Config, world: int, *, device: DeviceSpec | None = None, attention: str = "auto",
             prompt_lengths: Sequence[int] | None = None) -> MemoryPlan:
    """The memory plan of `cfg` on `world` ranks (per rank). Reads the models' config.json only.

    `prompt_lengths`: the training prompts' token counts (the trainer passes its dataset's); micro-batches
    are then sized from them, else every prompt counts as `data.max_prompt_tokens` long (an upper bound).
    Responses always count as `rollout.max_new_tokens` (`data.max_response_tokens` for offline pairs).
    """
    device = device or detect_device()
    actor, lora = _spec(cfg.model.path, "lm"), cfg.model.lora
    if lora.rank:  # build.py wraps the actor with peft: the base freezes, the adapters train
        params = lora_params(list(actor.params), rank=lora.rank, target_modules=lora.target_modules)
        # Adapted linears of one block: those the model has (a mixture's sparse blocks have no gate/up/down_proj).
        targets = len({p.name for p in params if p.block == 0 and p.name.endswith(".lora_A.default.weight")})
        actor = ModelSpec(tuple(params), actor.dims, "lm", lora.rank, targets,
                          frozen_param_bytes=DTYPE_BYTES[cfg.model.frozen_storage_dtype])
    a, frozen = cfg.algorithm, DTYPE_BYTES[cfg.model.frozen_storage_dtype]
    inputs = PlanInputs(
        actor=actor, world=world, device=device, compute_bytes=DTYPE_BYTES[cfg.model.dtype],
        **_tokens(cfg, world, prompt_lengths), rollout=_rollout(cfg, device), offload=OffloadSpec(**_offload(cfg)),
        reference=_spec(cfg.model.path, "lm", frozen) if a.use_reference and not lora.rank else None,
        reference_from_actor=a.use_reference and bool(lora.rank),
        critic=_spec(cfg.critic.path or cfg.model.path, "value") if a.use_critic else None,
        reward_model=_spec(cfg.reward.model_path, "score", frozen) if cfg.reward.model_path else None,
        teacher=_spec(cfg.teacher.path, "lm", frozen) if cfg.teacher.path else None,
        activation_checkpointing=cfg.model.activation_checkpointing,
        attention=_attention(attention, device), entropy=get_objective(a.objective).entropy,
        old_logp_pass=not a.old_logp_from_update, optimizer=cfg.optim.name, router_replay=cfg.model.moe.router_replay,
        shard=cfg.trainer.shard_size, shm_collectives=cfg.trainer.cpu_shm_collectives,
        prefix_share=cfg.rollout.n if _prefix_share(cfg, device) and not get_objective(a.objective).paired else 0,
    )
    try:
        inputs = choose_shard(inputs)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    plan = estimate(inputs)
    notes = tuple(_config_notes(cfg, actor, device))
    if not cfg.trainer.shard_size and world > 1:
        notes += (f"trainer.shard_size=0 (auto) chose {inputs.shard}: "
                  + ("the smallest shard size that fits (the most replicas)" if plan.fits else
                     "none with replicas fits"),)
    if prompt_lengths is None:
        notes += (f"prompts counted as data.max_prompt_tokens={cfg.data.max_prompt_tokens} long (an upper bound: the "
                  "training files were not read)",)
    return dataclasses.replace(plan, notes=plan.notes + notes)


def _prefix_share(cfg: Config, device: DeviceSpec) -> bool:
    """`trainer.prefix_share` on the planned device: null (auto) is on for a CPU and off for a GPU."""
    share = cfg.trainer.prefix_share
    return device.kind == "cpu" if share is None else share


def training_records(cfg: Config, tokenizer):
    """The training rows as `build.py` trains on them: preference pairs (offline DPO) or prompts, over-long ones
    dropped."""
    from hybrid_rl.data import load_preference_dataset, load_prompt_dataset

    d = cfg.data
    if cfg.algorithm.offline_pairs:
        return load_preference_dataset(d.train_files, tokenizer, max_prompt_tokens=d.max_prompt_tokens,
                                       max_response_tokens=d.max_response_tokens, prompt_key=d.prompt_key,
                                       apply_chat_template=d.apply_chat_template)
    return load_prompt_dataset(d.train_files, tokenizer, max_prompt_tokens=d.max_prompt_tokens,
                               prompt_key=d.prompt_key, apply_chat_template=d.apply_chat_template)


def prompt_lengths(cfg: Config) -> list[int] | None:
    """Token counts of the training prompts; None when the files are not on this machine (planning a run
    elsewhere: prompts then count as `data.max_prompt_tokens`)."""
    from hybrid_rl.model.loading import load_tokenizer

    if not all(Path(f).is_file() for f in cfg.data.train_files):
        return None
    return [len(r.prompt_ids) for r in training_records(cfg, load_tokenizer(cfg.model.path))]


def detect_device(kind: str = "auto", *, gib: float | None = None, local_ranks: int = 1) -> DeviceSpec:
    """This machine's memory per rank (CUDA device 0, or host memory available now / local ranks), or `gib`."""
    import torch

    cuda = torch.cuda.is_available()
    kind = ("cuda" if cuda else "cpu") if kind == "auto" else kind
    if gib is not None:
        return DeviceSpec(kind, int(gib * GIB), f"{kind} device of {gib:g} GiB (--device-gib)")
    if kind == "cuda":
        if not cuda:
            raise ConfigError("--device cuda on a machine without CUDA: also give its size, e.g. --device-gib 80")
        # The total vLLM's share is a fraction of (its start-up reads mem_get_info): an "80 GB" H100 is ~79.6 GiB.
        _, total = torch.cuda.mem_get_info(0)
        return DeviceSpec("cuda", total, torch.cuda.get_device_properties(0).name)
    available = memory.available_bytes()
    return DeviceSpec("cpu", available // local_ranks,
                      f"host memory available now ({available / GIB:.1f} GiB) / {local_ranks} local rank(s)")


def _spec(path: str, head: Head, param_bytes: int = 4) -> ModelSpec:
    from hybrid_rl.model.loading import load_config

    hf = load_config(path)
    return ModelSpec(tuple(model_params(hf, head)), ArchDims.from_hf_config(hf), head, param_bytes=param_bytes)


def _needs_rollout(cfg: Config) -> bool:
    return not cfg.algorithm.offline_pairs or bool(cfg.data.val_files)  # validation generates with vLLM too


def _lengths(cfg: Config, prompt_lengths: Sequence[int] | None) -> tuple[float, int, int]:
    """(mean prompt, longest prompt, response) token counts of one sample."""
    d, r = cfg.data, cfg.rollout
    response = d.max_response_tokens if cfg.algorithm.offline_pairs else r.max_new_tokens
    if prompt_lengths:
        mean, longest = sum(prompt_lengths) / len(prompt_lengths), max(prompt_lengths)
    else:
        mean = longest = d.max_prompt_tokens
    if r.max_model_len:  # vLLM never produces longer sequences
        response = min(response, max(r.max_model_len - longest, 1))
    return mean, longest, response


def _tokens(cfg: Config, world: int, prompt_lengths: Sequence[int] | None) -> dict[str, int]:
    """Tokens of the largest micro-batch (and its response tokens): this rank's share packed up to the budget,
    never less than the longest sample."""
    mean, longest, response = _lengths(cfg, prompt_lengths)
    budget, a = cfg.trainer.micro_batch_tokens, cfg.algorithm
    per_prompt = 2 if a.offline_pairs else cfg.rollout.n
    share = -(-cfg.data.prompts_per_step * per_prompt // world)
    mini = -(-share // a.mini_batches)
    seq, longest_seq = mean + response, longest + response

    def micro(samples: int) -> tuple[int, int]:
        tokens = max(longest_seq, min(budget, int(samples * seq)))
        return tokens, min(tokens, int(tokens * response / seq) + response)

    (pass_tokens, pass_responses), (update_tokens, update_responses) = micro(share), micro(mini)
    return dict(pass_tokens=pass_tokens, update_tokens=update_tokens, pass_responses=pass_responses,
                update_responses=update_responses, micro_batch_tokens=budget, max_sequence_tokens=longest_seq,
                max_response_tokens=response,
                step_tokens=int(share * seq))


def _rollout(cfg: Config, device: DeviceSpec) -> RolloutSpec:
    r, d = cfg.rollout, resolve_rollout(cfg.rollout, device.kind)  # as build.py resolves it
    return RolloutSpec(
        # sidecar: vLLM runs in its own server process, outside the trainer ranks this plan is about (`_sidecar_notes`)
        enabled=_needs_rollout(cfg) and r.mode == "colocated", tp=r.tp, dtype_bytes=DTYPE_BYTES[r.dtype],
        kv_cache_bytes=None if d.kv_cache_gb is None else int(d.kv_cache_gb * GIB),
        gpu_memory_utilization=d.gpu_memory_utilization, release=d.release, bucket_bytes=int(r.bucket_mb * 2**20),
        max_model_len=r.max_model_len or cfg.data.max_prompt_tokens + r.max_new_tokens,
        lora_adapter=bool(cfg.model.lora.rank) and cfg.model.lora.sync == "adapter",
    )


def _offload(cfg: Config) -> dict[str, str]:
    return {f.name: getattr(cfg.offload, f.name) for f in dataclasses.fields(OffloadSpec)}


def _attention(choice: str, device: DeviceSpec) -> str:
    """The attention the run will have: flash-attn only where this install can import it (no prebuilt wheel matches
    torch 2.13, so a CUDA install may well lack it: docs/install.md), else the per-sequence SDPA. A GPU run planned
    from another machine is planned with this machine's install; `--attention flash` plans one that has it."""
    if choice != "auto":
        return choice
    import importlib.util

    import torch

    if device.kind == "cuda" and not torch.cuda.is_available():
        return "flash" if importlib.util.find_spec("flash_attn") is not None else "sdpa"
    from hybrid_rl.model.loading import attn_implementation

    return "flash" if attn_implementation() == "flash_attention_2" else "sdpa"


def _config_notes(cfg: Config, actor: ModelSpec, device: DeviceSpec) -> list[str]:
    from hybrid_rl.weightsync.layout import ARCHITECTURES

    notes = []
    if cfg.model.lora.rank:
        adapters = sum(p.numel for p in actor.params if p.trainable)
        notes.append(f"LoRA rank {cfg.model.lora.rank}: {adapters} adapter parameters train; the reference pass is "
                     "the actor with the adapter disabled")
    if actor.dims.architecture not in ARCHITECTURES:
        notes.append(f"{actor.dims.architecture} has no vLLM weight layout (weightsync/layout.py): hybrid_rl.train "
                     "refuses it; sizes come from a meta-device instance")
    if cfg.rollout.mode == "sidecar":
        notes += _sidecar_notes(cfg, actor, device)
    elif device.kind == "cpu" and cfg.rollout.release in ("auto", "keep"):
        notes.append("rollout.release=keep (the CPU default): vLLM's weights and KV cache stay in memory in every "
                     "phase")
    return notes


def _sidecar_notes(cfg: Config, actor: ModelSpec, device: DeviceSpec) -> list[str]:
    """What sidecar mode puts outside the trainer ranks' plan: said, with the numbers known from the config."""
    r, sc = cfg.rollout, cfg.sidecar
    weights = sum(p.numel for p in actor.params) * DTYPE_BYTES[r.dtype] / r.tp / GIB
    d = resolve_rollout(r, device.kind)
    kv = f"{d.kv_cache_gb:g} GiB" if d.kv_cache_gb is not None else \
        f"what rollout.gpu_memory_utilization ({d.gpu_memory_utilization or 'auto'}) leaves"
    ring = sc.slots * r.bucket_mb / 1024
    where = "GPU memory while it is awake" if device.kind == "cuda" else "host RAM, always (no sleep mode on CPU)"
    return [
        "rollout.mode=sidecar: not counted above (the vLLM server is its own process): per server TP rank "
        f"{weights:.2f} GiB of weights and a KV cache of {kv}, in {where}, plus the server process itself "
        "(~1-2 GiB of host RAM for a tiny model on CPU)",
        f"rollout.mode=sidecar: not counted above: the checkpoint engine's shared memory, {sc.slots} slots x "
        f"{r.bucket_mb:g} MiB = {ring:.2f} GiB per server TP rank on each pod (in /dev/shm; pinned host memory on "
        "CUDA), and one bucket of resharding buffers on each trainer rank during an update",
    ]
