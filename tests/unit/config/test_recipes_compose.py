"""Every shipped recipe composes and validates; the objective recipes carry their papers' settings, and the
objective and clip settings are checked at start-up with one clear line."""

import pytest

from hybrid_rl.config import RECIPES_DIR, Config, ConfigError, load_config, resolve_correction, validate

REQUIRED = ["model.path=/m", "data.train_files=[/d.jsonl]"]
RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
NEEDS = {"opd": ["teacher.path=/teacher"]}  # what a recipe cannot ship with, besides the model and the data


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe):
    cfg = load_config(recipe, [*REQUIRED, *NEEDS.get(recipe, [])])
    assert cfg.algorithm.name


def test_gspo_recipe_has_the_papers_settings():
    a = load_config("gspo", REQUIRED).algorithm
    assert (a.objective, a.advantage, a.clip_low, a.clip_high) == ("gspo", "grpo", 3e-4, 4e-4)
    assert a.loss_agg == "seq-mean-token-mean" and a.mini_batches > 1 and a.kl_coef == 0


def test_cispo_recipe_has_the_spec_defaults():
    a = load_config("cispo", REQUIRED).algorithm
    assert (a.objective, a.clip_low, a.clip_high, a.loss_agg) == ("cispo", None, 0.2, "token-mean")
    assert a.mini_batches > 1


@pytest.mark.parametrize("objective", ["gspo", "cispo"])
def test_new_objectives_on_any_recipe_and_with_rollout_correction(objective):
    cfg = load_config("grpo", [*REQUIRED, f"algorithm.objective={objective}", "algorithm.rollout_correction=mis"])
    assert cfg.algorithm.objective == objective
    cfg.rollout.mode, cfg.rollout.max_staleness, cfg.algorithm.rollout_correction = "sidecar", 1, "auto"
    validate(cfg)
    assert resolve_correction(cfg) == "tis"  # asynchronous: the policy gradient is reweighted, as for ppo_clip


def test_unknown_objective_and_unbounded_clip_are_refused_with_one_line():
    with pytest.raises(ConfigError, match="algorithm.objective='grpo' is not allowed; choose one of: ppo_clip, gspo, "
                                          "cispo, dpo"):
        load_config("grpo", [*REQUIRED, "algorithm.objective=grpo"])
    with pytest.raises(ConfigError, match=r"clip_low=null \(no lower bound\) is for .*\(cispo\); "
                                          "algorithm.objective=gspo needs a number"):
        load_config("gspo", [*REQUIRED, "algorithm.clip_low=null"])
    with pytest.raises(ConfigError, match="algorithm.dual_clip=3.0 is for ppo_clip; algorithm.objective=gspo has no dual"):
        load_config("gspo", [*REQUIRED, "algorithm.dual_clip=3"])
    cfg = Config()
    cfg.model.path, cfg.data.train_files, cfg.algorithm.objective = "/m", ["/d.jsonl"], "cispo"
    cfg.algorithm.clip_low = 1.5
    with pytest.raises(ConfigError, match=r"clip_low=1.5 must be in \[0, 1\)"):
        validate(cfg)


def test_opd_recipe_is_pure_distillation_and_needs_a_teacher():
    cfg = load_config("opd", [*REQUIRED, "teacher.path=/teacher"])
    a = cfg.algorithm
    assert a.opd_coef == 1.0 and a.objective == "ppo_clip" and not a.use_reference
    assert not cfg.reward.fns and not cfg.reward.fn and not cfg.reward.model_path  # no reward: pure distillation
    assert not a.old_logp_from_update  # the advantages need the student's log-probs before the update
    with pytest.raises(ConfigError, match=r"^algorithm.opd_coef=1.0 distils from a teacher: set teacher.path="):
        load_config("opd", REQUIRED)


@pytest.mark.parametrize("overrides,message", [
    (["teacher.path=/t"], "teacher.path is set but algorithm.opd_coef=0"),
    (["teacher.path=/t", "algorithm.opd_coef=1", "algorithm.objective=dpo"], "teacher.path is for on-policy "
                                                                             "distillation"),
    (["reward.fns=[]"], "no reward: set reward.fns"),
    (["algorithm.opd_coef=-1", "teacher.path=/t"], "algorithm.opd_coef=-1.0 must be >= 0"),
    (["offload.teacher=gpu"], "offload.teacher='gpu' is not allowed"),
])
def test_distillation_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("grpo", [*REQUIRED, *overrides])


def test_distillation_on_top_of_a_reward_and_offloaded_teacher_are_accepted():
    cfg = load_config("grpo", [*REQUIRED, "teacher.path=/t", "algorithm.opd_coef=0.5", "offload.teacher=disk"])
    assert cfg.reward.fns and cfg.algorithm.opd_coef == 0.5 and cfg.offload.teacher == "disk"
