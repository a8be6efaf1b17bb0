"""Offline vs online DPO is the field `algorithm.offline_pairs`, set by the recipe, not read from its name."""

import pytest

from hybrid_rl.config import ConfigError, load_config

REQUIRED = ["model.path=/m", "data.train_files=[/d.jsonl]"]


def test_the_dpo_recipe_trains_offline_pairs_and_online_dpo_generates():
    assert load_config("dpo", REQUIRED).algorithm.offline_pairs
    assert not load_config("online_dpo", REQUIRED).algorithm.offline_pairs


def test_a_dpo_recipe_under_another_name_keeps_its_pairs():
    renamed = load_config("online_dpo", [*REQUIRED, "algorithm.name=my_dpo"])
    assert renamed.algorithm.objective == "dpo" and not renamed.algorithm.offline_pairs
    assert load_config("dpo", [*REQUIRED, "algorithm.name=pref"]).algorithm.offline_pairs


def test_offline_pairs_need_the_dpo_objective():
    with pytest.raises(ConfigError, match="algorithm.offline_pairs=true .* needs algorithm.objective=dpo"):
        load_config("grpo", [*REQUIRED, "algorithm.offline_pairs=true"])
