"""A run's resolved config.yaml composes back to the same config."""

from hybrid_rl.config import load_config, resolved_yaml, to_dict


def test_the_resolved_yaml_recomposes_to_the_same_config(tiny_models, tmp_path):
    cfg = load_config("dapo", [f"model.path={tiny_models['qwen2']}", "data.train_files=[a.jsonl,b.jsonl]",
                               "rollout.n=3", "algorithm.clip_high=0.3", "reward.fns=[{name: format, weight: 0.5, "
                               "pattern: 'x.*'}]", "optim.betas=[0.8,0.9]", "trainer.max_logprob_diff=null"])
    path = tmp_path / "config.yaml"
    path.write_text(resolved_yaml(cfg))
    again = load_config(str(path), [])
    assert to_dict(again) == to_dict(cfg)
    assert to_dict(load_config(str(path), ["rollout.n=5"]))["rollout"]["n"] == 5  # overrides still apply
