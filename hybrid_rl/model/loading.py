"""Load Hugging Face models and tokenizers from a local folder (never from a hub).

`load_causal_lm` / `load_critic` / `load_reward_model` load the whole model on this process (tools,
tests, single-process use). The trainer instead builds `empty_model` (parameters on the meta
device), shards it, and fills each rank's shards from the checkpoint (`model/materialize.py`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybrid_rl.types import Head

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_dir(path: str) -> Path:
    """A clear error for a model folder that does not exist or is not a Hugging Face model."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"model.path={path!r} is not a directory (expected a Hugging Face model folder)")
    if not (p / "config.json").is_file():
        raise ValueError(f"model.path={path!r} has no config.json (expected a Hugging Face model folder)")
    return p


def attn_implementation() -> str:
    """flash-attn on CUDA where installed (packed sequences run as varlen), else SDPA per packed sequence."""
    if torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    from hybrid_rl.model.attention import register

    return register()


def load_causal_lm(path: str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    from transformers import AutoModelForCausalLM

    check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation())
    return model.to(device)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    check_model_dir(path)
    return AutoTokenizer.from_pretrained(path)


def load_config(path: str):
    from transformers import AutoConfig

    check_model_dir(path)
    hf = AutoConfig.from_pretrained(path)
    check_unquantized(hf, path)
    return hf


def check_unquantized(hf_config, path: str) -> None:
    """Refuse a quantized checkpoint (FP8, AWQ, GPTQ, bitsandbytes, ...): its weights are not the trainable tensors
    the loader, the resharder and vLLM's unquantized landing expect. An FP8 weight is a float dtype, so it would pass
    every later check and be trained and synced as if it were the model's weights."""
    q = getattr(hf_config, "quantization_config", None)
    if q:
        method = (q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)) or "unknown"
        raise ValueError(f"model.path={path!r} is a quantized checkpoint (quantization_config: {method}); training "
                         "needs the unquantized weights: point model.path at the original (bf16/fp16/fp32) model")


def load_critic(path: str, *, device: torch.device | str = "cpu"):
    """A value model: the policy's backbone with a 1-output token head (`...ForTokenClassification`)."""
    from transformers import AutoModelForTokenClassification

    _quiet_value_head_warning()
    check_model_dir(path)
    model = AutoModelForTokenClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32, attn_implementation=attn_implementation())
    return model.to(device)


def _quiet_value_head_warning() -> None:
    import warnings

    # The head's output is a view; FSDP2 warns that in-place ops on it would skip a hook. We never do any.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def empty_model(path: str, head: Head, *, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model of folder `path` as the loaders build it, with every parameter on the meta device.

    `head`: "lm" (`AutoModelForCausalLM`, as `load_causal_lm`), "value" (a 1-output token head, as
    `load_critic`) or "score" (a 1-output sequence head, as `load_reward_model`). Parameters take no
    memory until `model.materialize.materialize` fills them; buffers (rotary `inv_freq`, which no
    checkpoint holds) are computed on the CPU by the modules themselves, as `from_config` would.
    The model is in eval mode with its generation config read from the folder, as `from_pretrained`
    returns it.
    """
    from accelerate import init_empty_weights
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        GenerationConfig,
    )

    config = load_config(path)
    auto = {"lm": AutoModelForCausalLM, "value": AutoModelForTokenClassification,
            "score": AutoModelForSequenceClassification}[head]
    if head != "lm":
        config.num_labels = 1
    if head == "value":
        _quiet_value_head_warning()
    with init_empty_weights(include_buffers=False):
        model = auto.from_config(config, dtype=dtype, attn_implementation=attn_implementation())
    model.tie_weights()  # init_empty_weights re-registers each parameter, which unties a tied head
    if head == "lm" and (Path(path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def load_reward_model(path: str, *, device: torch.device | str = "cpu"):
    """A sequence-classification reward model folder (one score per sequence)."""
    from transformers import AutoModelForSequenceClassification

    check_model_dir(path)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32, attn_implementation=attn_implementation())
    return model.to(device).eval()


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder block in backward instead of keeping its activations.

    transformers checkpoints a block only when the block's `training` flag is set, and
    `from_pretrained` returns the model in eval mode. Setting the flag on the blocks alone (not
    `model.train()`) keeps every dropout off, so log-probs stay deterministic across passes.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m.training = True
