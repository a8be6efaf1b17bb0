"""`algorithm.rollout_correction` and its thresholds are validated at start-up, naming key and allowed values."""

import pytest

from hybrid_rl.config import Config, ConfigError, validate


def _cfg(**algorithm) -> Config:
    cfg = Config()
    cfg.model.path, cfg.data.train_files = "/m", ["/d.jsonl"]
    for k, v in algorithm.items():
        setattr(cfg.algorithm, k, v)
    return cfg


def test_the_default_is_none_and_every_mode_and_level_is_accepted():
    assert Config().algorithm.rollout_correction == "none"
    for mode in ("none", "tis", "mis"):
        for level in ("token", "sequence"):
            validate(_cfg(rollout_correction=mode, rollout_correction_level=level))


@pytest.mark.parametrize("key,value,message", [
    ("rollout_correction", "is", "algorithm.rollout_correction='is' is not allowed; choose one of: none, tis, mis"),
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
    with pytest.raises(ConfigError, match="algorithm.rollout_correction=mis reweights the ppo_clip policy gradient; "
                                          "algorithm.objective=dpo has none to reweight"):
        validate(_cfg(name=name, objective="dpo", rollout_correction="mis"))
