"""`algorithm.rollout_correction` and its thresholds are validated at start-up, naming key and allowed values;
`auto` (the default) is resolved from the run: on in asynchronous runs, off in synchronous ones."""

import pytest

from hybrid_rl.config import Config, ConfigError, resolve_correction, validate


def _cfg(**algorithm) -> Config:
    cfg = Config()
    cfg.model.path, cfg.data.train_files = "/m", ["/d.jsonl"]
    for k, v in algorithm.items():
        setattr(cfg.algorithm, k, v)
    return cfg


def test_the_default_is_auto_and_every_mode_and_level_is_accepted():
    assert Config().algorithm.rollout_correction == "auto"
    for mode in ("auto", "none", "tis", "mis"):
        for level in ("token", "sequence"):
            validate(_cfg(rollout_correction=mode, rollout_correction_level=level))


@pytest.mark.parametrize("staleness,objective,name,mode,expected", [
    (0, "ppo_clip", "grpo", "auto", "none"),  # synchronous: on-policy, as before
    (1, "ppo_clip", "grpo", "auto", "tis"),  # asynchronous: truncated IS by default
    (2, "ppo_clip", "ppo", "auto", "tis"),
    (2, "dpo", "online_dpo", "auto", "none"),  # no policy gradient to reweight
    (2, "ppo_clip", "grpo", "none", "none"),  # an explicit choice stands
    (0, "ppo_clip", "grpo", "mis", "mis"),
])
def test_auto_resolves_from_the_staleness_and_the_objective(staleness, objective, name, mode, expected):
    cfg = _cfg(rollout_correction=mode, objective=objective, name=name)
    cfg.rollout.mode, cfg.rollout.max_staleness = "sidecar", staleness
    validate(cfg)
    assert resolve_correction(cfg) == expected


def test_asynchronous_training_needs_sidecar_mode_and_a_non_negative_staleness():
    cfg = _cfg()
    cfg.rollout.max_staleness = 1
    with pytest.raises(ConfigError, match="rollout.max_staleness=1 needs rollout.mode=sidecar"):
        validate(cfg)
    cfg.rollout.mode, cfg.rollout.max_staleness = "sidecar", -1
    with pytest.raises(ConfigError, match="rollout.max_staleness=-1 must be >= 0"):
        validate(cfg)
    cfg.rollout.max_staleness = 5  # larger values are allowed (the staleness metrics show what they cost)
    validate(cfg)


@pytest.mark.parametrize("key,value,message", [
    ("rollout_correction", "is",
     "algorithm.rollout_correction='is' is not allowed; choose one of: auto, none, tis, mis"),
    ("rollout_correction_level", "geometric",
     "algorithm.rollout_correction_level='geometric' is not allowed; choose one of: token, sequence"),
    ("rollout_correction_low", 1.5, r"rollout_correction_low=1.5 and rollout_correction_high=2.0 must satisfy"),
    ("rollout_correction_low", -0.1, r"rollout_correction_low=-0.1 .* 0 <= low <= 1 <= high"),
    ("rollout_correction_high", 0.9, r"rollout_correction_high=0.9 must satisfy"),
    ("rollout_correction_high", float("inf"), r"rollout_correction_high=inf must satisfy .* \(finite\)"),
])
def test_bad_values_name_the_key_and_what_is_allowed(key, value, message):
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(**{"rollout_correction": "tis", key: value}))


@pytest.mark.parametrize("name", ["dpo", "online_dpo"])
def test_dpo_refuses_a_correction(name):
    validate(_cfg(name=name, objective="dpo"))  # none is fine
    with pytest.raises(ConfigError, match="algorithm.rollout_correction=mis reweights the policy gradient of ppo_clip, gspo, cispo; "
                                          "algorithm.objective=dpo has none to reweight"):
        validate(_cfg(name=name, objective="dpo", rollout_correction="mis"))
