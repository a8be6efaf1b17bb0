"""The wiring's registries: one entry per deployment the config allows, and the trainer's settings read from the
config, not from a label."""

from hybrid_rl.build import DEPLOYMENTS
from hybrid_rl.build.settings import trainer_settings
from hybrid_rl.config import allowed_values, load_config


def test_every_rollout_mode_has_its_checks_and_builder():
    assert set(DEPLOYMENTS) == set(allowed_values("rollout.mode"))
    for entry in DEPLOYMENTS.values():
        assert callable(entry.check) and callable(entry.build)


def test_trainer_settings_follow_the_config(tiny_models):
    def settings(recipe, *extra):
        cfg = load_config(recipe, [f"model.path={tiny_models['qwen2']}", "data.train_files=[x.jsonl]", *extra])
        return cfg, trainer_settings(cfg, world=2)

    cfg, s = settings("dpo")
    assert s.offline_pairs is True and cfg.algorithm.offline_pairs is True
    cfg, s = settings("online_dpo")
    assert s.offline_pairs is False
    cfg, s = settings("grpo", "algorithm.value_clip=0.3")
    assert s.value_clip == 0.3 and s.config["algorithm"]["value_clip"] == 0.3
