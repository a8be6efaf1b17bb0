"""`model.moe.router_replay`: its choices, the trainer's setting for MoE and dense models, and sidecar mode's refusal
of `rollout` replay asked for by name (the servers return no routes), where the default, `auto`, falls back to `old`
with one warning."""

import logging

import pytest

from hybrid_rl.build.settings import trainer_settings
from hybrid_rl.config import ConfigError, allowed_values, load_config


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from hybrid_rl.model.tiny import TinySpec, build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {name: str(build_tiny_model(root / name, TinySpec(arch=name))) for name in ("qwen3_moe", "qwen2")}


def _cfg(path, *extra):
    return load_config("grpo", [f"model.path={path}", "data.train_files=[x.jsonl]", *extra])


def test_choices_and_default(models):
    assert set(allowed_values("model.moe.router_replay")) == {"auto", "none", "old", "rollout"}
    assert _cfg(models["qwen3_moe"]).model.moe.router_replay == "rollout"  # auto, resolved colocated
    assert _cfg(models["qwen2"]).model.moe.router_replay == "none"
    with pytest.raises(ConfigError, match="model.moe.router_replay"):
        _cfg(models["qwen3_moe"], "model.moe.router_replay=r3")


def test_the_trainer_gets_the_mode_for_moe_and_none_for_dense(models, caplog):
    for mode in ("none", "old", "rollout"):
        s = trainer_settings(_cfg(models["qwen3_moe"], f"model.moe.router_replay={mode}"), world=2)
        assert s.router_replay == mode
    with caplog.at_level(logging.WARNING):
        assert trainer_settings(_cfg(models["qwen2"]), world=2).router_replay == "none"
        assert not caplog.records  # the default says nothing about a dense model
        assert trainer_settings(_cfg(models["qwen2"], "model.moe.router_replay=old"), world=2).router_replay == "none"
    assert len(caplog.records) == 1 and "ignored" in caplog.records[0].getMessage()


def test_sidecar_mode_refuses_rollout_replay_of_an_moe_model_and_auto_falls_back_to_old(models, caplog, monkeypatch):
    with pytest.raises(ConfigError, match="router_replay=rollout is not supported with rollout.mode=sidecar"):
        _cfg(models["qwen3_moe"], "rollout.mode=sidecar", "model.moe.router_replay=rollout")
    for recipe in ("grpo", "grpo_moe"):  # the default and the MoE recipe: old, said once (on rank 0 only)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            cfg = load_config(recipe, [f"model.path={models['qwen3_moe']}", "data.train_files=[x.jsonl]",
                                       "rollout.mode=sidecar"])
        assert cfg.model.moe.router_replay == "old"
        assert trainer_settings(cfg, world=2).router_replay == "old"
        said = [r.getMessage() for r in caplog.records if "router_replay" in r.getMessage()]
        assert len(said) == 1 and "auto: old in sidecar mode" in said[0], said
    monkeypatch.setenv("RANK", "1")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert _cfg(models["qwen3_moe"], "rollout.mode=sidecar").model.moe.router_replay == "old"
    assert not [r for r in caplog.records if "router_replay" in r.getMessage()]
    for cfg in (_cfg(models["qwen3_moe"], "rollout.mode=sidecar", "model.moe.router_replay=old"),
                _cfg(models["qwen2"], "rollout.mode=sidecar")):
        assert cfg.rollout.mode == "sidecar"


def test_lora_on_a_mixture_of_experts_adapts_attention_and_experts_merged(models):
    """Attention and the fused experts (`experts`, or one of its two tensors) are accepted with the merged sync;
    gate_proj/up_proj (the experts' halves, which peft cannot adapt apart), adapter sync (vLLM's LoRA over its
    fused-MoE layer is not verified) and dropout on the experts are refused, naming what works."""
    attention = "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"
    for bad in ([], [attention], ["model.lora.sync=merged"],  # default targets name gate_proj/up_proj; default sync
                ["model.lora.target_modules=[q_proj,experts]"]):
        with pytest.raises(ConfigError, match=r"supports target_modules within \['down_proj', 'experts', "
                                              r"'gate_up_proj', 'k_proj', 'o_proj', 'q_proj', 'v_proj'\] with "
                                              r"model.lora.sync=merged"):
            _cfg(models["qwen3_moe"], "model.lora.rank=8", *bad)
    for targets in ("[q_proj,k_proj,v_proj,o_proj]", "[q_proj,v_proj,experts]", "[down_proj]"):
        cfg = _cfg(models["qwen3_moe"], "model.lora.rank=8", f"model.lora.target_modules={targets}",
                   "model.lora.sync=merged")
        assert cfg.model.lora.rank == 8
    with pytest.raises(ConfigError, match="model.lora.dropout=0.1 with the experts"):
        _cfg(models["qwen3_moe"], "model.lora.rank=8", "model.lora.target_modules=[experts]", "model.lora.sync=merged",
             "model.lora.dropout=0.1")
    assert _cfg(models["qwen2"], "model.lora.rank=8").model.lora.sync == "adapter"  # dense models: unchanged