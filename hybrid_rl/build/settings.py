"""Config -> the trainer's typed settings (`components.TrainerSettings`): every field the trainer reads, named."""

from __future__ import annotations

import logging
from pathlib import Path

from hybrid_rl.algos.correction import CorrectionSettings
from hybrid_rl.algos.estimators import AdvantageSettings
from hybrid_rl.algos.objectives import ObjectiveSettings, get_objective
from hybrid_rl.components import KLSettings, LoopSettings, PassSettings, TrainerSettings
from hybrid_rl.config import Config, resolve_correction, to_dict
from hybrid_rl.experience.batch import BatchSettings
from hybrid_rl.experience.source import SourceSettings
from hybrid_rl.model.families import is_moe_folder
from hybrid_rl.updates import UpdateSettings

log = logging.getLogger(__name__)
FROZEN_MODELS = ("reference", "critic", "reward_model", "teacher")  # the models the trainer brings in and sends away


def trainer_settings(cfg: Config, *, world: int, distil_only: bool = False) -> TrainerSettings:
    """`distil_only`: the run has no reward of any kind (no reward function, no reward model), so its advantages
    are the distillation term alone."""
    a, t, r = cfg.algorithm, cfg.trainer, cfg.rollout
    correction = CorrectionSettings(mode=resolve_correction(cfg), level=a.rollout_correction_level,
                                    low=a.rollout_correction_low, high=a.rollout_correction_high)
    loss = ObjectiveSettings(loss_agg=a.loss_agg, clip_low=a.clip_low, clip_high=a.clip_high,
                             dual_clip=a.dual_clip or None, kl_coef=0.0 if a.kl_in_reward else a.kl_coef,
                             kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef, dpo_beta=a.dpo_beta,
                             dpo_kind=a.dpo_kind, dpo_label_smoothing=a.dpo_label_smoothing, correction=correction)
    updates = UpdateSettings(epochs=a.ppo_epochs, mini_batches=a.mini_batches, budget=t.micro_batch_tokens,
                             temperature=r.temperature, grad_clip=cfg.optim.grad_clip, horizon=r.max_new_tokens,
                             world=world, prefix_share=prefix_share(cfg))
    batch = BatchSettings(estimator="" if get_objective(a.objective).paired else a.advantage,
                          advantage=AdvantageSettings(gamma=a.gamma, lam=a.lam, norm_by_std=a.norm_by_std),
                          kl_in_reward=a.kl_in_reward, kl_estimator=a.kl_estimator, max_new_tokens=r.max_new_tokens,
                          overlong_buffer=a.overlong_buffer, overlong_penalty=a.overlong_penalty,
                          rm_weight=cfg.reward.model_weight, opd_coef=a.opd_coef, distil_only=distil_only)
    source = SourceSettings(n=r.n, prompts_per_step=cfg.data.prompts_per_step, dynamic_sampling=a.dynamic_sampling,
                            max_sampling_rounds=a.max_sampling_rounds, offline_pairs=a.offline_pairs,
                            max_staleness=r.max_staleness, seed=t.seed, max_restarts=cfg.sidecar.max_restarts,
                            speculative=r.speculative != "off")
    loop = LoopSettings(output_dir=Path(t.output_dir), total_steps=t.total_steps, save_every=t.save_every,
                        val_every=t.val_every, keep_last=t.keep_last, resume=t.resume, export=t.export,
                        show_progress=t.show_progress, max_bad_steps=t.max_bad_steps,
                        max_logprob_diff=t.max_logprob_diff, val_greedy=r.val_greedy)
    return TrainerSettings(
        objective=a.objective, offline_pairs=a.offline_pairs, value_clip=a.value_clip, loop=loop,
        kl=KLSettings(coef=a.kl_coef, target=a.kl_target, horizon=a.kl_horizon, estimator=a.kl_estimator),
        passes=PassSettings(old_logp_from_update=a.old_logp_from_update, use_reference=a.use_reference,
                            temperature=r.temperature, budget=t.micro_batch_tokens,
                            prefix_share=prefix_share(cfg)),
        loss=loss, updates=updates, batch=batch, source=source,
        offload={name: getattr(cfg.offload, name) for name in FROZEN_MODELS}, config=to_dict(cfg),
        router_replay=router_replay(cfg))


def prefix_share(cfg: Config) -> bool:
    """`trainer.prefix_share` where the attention supports it: flash-attn's varlen kernels (CUDA with flash-attn
    installed) have no prefix-shared layout, so it is off there, with a warning when it was asked for. Null (auto):
    on on CPU, off on CUDA (not run on a GPU yet; `plan_inputs` decides the same for the plan's device)."""
    share = cfg.trainer.prefix_share
    if share is None:
        import torch

        return not torch.cuda.is_available()
    if not share:
        return False
    from hybrid_rl.model.loading import attn_implementation

    if attn_implementation() == "flash_attention_2":
        log.warning("trainer.prefix_share is off: flash-attn's varlen attention has no prefix-shared layout "
                    "(uninstall flash-attn to use the packed SDPA, which has)")
        return False
    return True


def router_replay(cfg: Config) -> str:
    """`model.moe.router_replay` for the model at hand: a dense model has no routes, so `none` (a warning when `old`
    was asked for; `rollout` and the default, `auto`, say nothing about a dense model). `load_config` has resolved
    `auto` already (`config.resolve_router_replay`); a config built otherwise gets the same choice here, silently."""
    mode = cfg.model.moe.router_replay
    if is_moe_folder(cfg.model.path):
        if mode == "auto":
            return "old" if cfg.rollout.mode == "sidecar" else "rollout"
        return mode
    if mode == "old":
        log.warning("model.moe.router_replay=old is ignored: %s is a dense model (no experts to route)",
                    cfg.model.path)
    return "none"
