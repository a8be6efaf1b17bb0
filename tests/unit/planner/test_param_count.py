"""Parameter shapes from config.json alone equal the real modules' `named_parameters()`, name for name."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, MistralConfig

from hybrid_rl.config import LoraConfig
from hybrid_rl.model.loading import load_causal_lm, load_config, load_critic, load_reward_model
from hybrid_rl.model.lora import apply_lora
from hybrid_rl.planner.param_count import lora_params, meta_params, model_params
from hybrid_rl.planner.shards import shard_bytes

from .conftest import ARCHS


def _real(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], bool]]:
    return [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]


def _mine(params) -> list[tuple[str, tuple[int, ...], bool]]:
    return [(p.name, p.shape, p.trainable) for p in params]


@pytest.mark.parametrize("name", ARCHS)
def test_causal_lm_shapes_and_bytes_are_exact(arch_paths, name):
    model = load_causal_lm(arch_paths[name])
    params = model_params(load_config(arch_paths[name]))
    assert _mine(params) == _real(model)
    assert shard_bytes(params, world=1).params == sum(p.numel() * p.element_size() for p in model.parameters())


def test_tied_embeddings_are_counted_once(arch_paths):
    params = model_params(load_config(arch_paths["llama_tied_kv1"]))
    assert not any(p.name == "lm_head.weight" for p in params)
    untied = model_params(load_config(arch_paths["qwen2"]))
    assert [p.shape for p in untied if p.name == "lm_head.weight"] == [(untied[0].shape[0], untied[0].shape[1])]


@pytest.mark.parametrize("name", ARCHS)
def test_critic_and_reward_model_heads(arch_paths, name):
    hf = load_config(arch_paths[name])
    assert _mine(model_params(hf, "value")) == _real(load_critic(arch_paths[name]))  # score: weight + bias
    assert _mine(model_params(hf, "score")) == _real(load_reward_model(arch_paths[name]))  # score: weight only


@pytest.mark.parametrize("arch,targets", [("qwen3", LoraConfig().target_modules), ("qwen3", ["q_proj", "v_proj"]),
                                          ("qwen3_moe", ["q_proj", "experts"]), ("qwen3_moe", ["down_proj"])])
def test_lora_shapes_and_trainable_flags(tiny_models, arch, targets):
    model = apply_lora(load_causal_lm(tiny_models[arch]), rank=4, alpha=8.0, dropout=0.0, target_modules=targets)
    base = model_params(load_config(tiny_models[arch]))
    assert _mine(lora_params(base, rank=4, target_modules=targets)) == _real(model)


def test_mistral_and_unknown_architectures():
    mistral = MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, vocab_size=100, architectures=["MistralForCausalLM"])
    gpt2 = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)  # meta path
    for config in (mistral, gpt2):
        real = [(n, tuple(p.shape), True) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()]
        assert _mine(model_params(config)) == real
    assert _mine(meta_params(mistral)) == _mine(model_params(mistral))
