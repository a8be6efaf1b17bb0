"""Qwen2.5-shaped model folders: the published configs, random weights saved in bf16 as real checkpoints are.

    folder("0.5B") -> benchmarks/.cache/models/qwen2.5-0.5b-shape   (built once, offline; a tiny tokenizer)

Weights are written in safetensors shards of at most ~1 GiB with an index, one tensor at a time, so
building the 7B folder needs ~1 GiB of memory, not 15. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import common

# Published config.json values of Qwen2.5-{0.5B,1.5B,3B,7B,32B}(-Instruct). The untied sizes pad their vocabulary
# to 152064 rows, the tied ones to 151936.
SHAPES = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True, max_window_layers=21, vocab_size=151936),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True, max_window_layers=21, vocab_size=151936),
    "3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, tie_word_embeddings=True, max_window_layers=70, vocab_size=151936),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False, max_window_layers=28, vocab_size=152064),
    "32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, tie_word_embeddings=False, max_window_layers=64, vocab_size=152064),
}
# Published config.json of Qwen3-30B-A3B (a mixture of experts: 128 experts of width 768, 8 per token, every layer
# sparse; 30.5B parameters, 3.3B active). Planned at real size (docs/guides/moe.md); no weights are built for it.
MOE_SHAPES = {
    "30B-A3B": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                    tie_word_embeddings=False, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                    rms_norm_eps=1e-6, attention_bias=False),
}
COMMON = dict(rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-6,
              use_sliding_window=False, sliding_window=32768)
SHARD_BYTES = 1 << 30


def config(size: str):
    from transformers import Qwen2Config

    from hybrid_rl.model.tiny import build_tokenizer

    tok = build_tokenizer()
    if size in MOE_SHAPES:
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig(**MOE_SHAPES[size], eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             bos_token_id=tok.eos_token_id, dtype="bfloat16")
        cfg.architectures = ["Qwen3MoeForCausalLM"]
        return cfg, tok
    cfg = Qwen2Config(**SHAPES[size], **COMMON, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.eos_token_id, dtype="bfloat16")
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg, tok


def _stale(path: Path, size: str) -> bool:
    """Whether `path` holds a config.json that no longer has SHAPES[size] (a folder built before a correction)."""
    saved = json.loads((path / "config.json").read_text())
    return any(saved.get(k) != v for k, v in {**SHAPES, **MOE_SHAPES}[size].items())


def config_folder(size: str) -> Path:
    """`size`'s config and tokenizer without weights: enough for the memory planner (`scale.py --plan-only`)."""
    path = common.CACHE / "models" / f"qwen2.5-{size.lower()}-config"
    if not (path / "config.json").exists() or _stale(path, size):
        cfg, tok = config(size)
        tok.save_pretrained(path)
        cfg.save_pretrained(path)
    return path


def folder(size: str) -> Path:
    """The model folder of `size` (one of SHAPES), built on first use."""
    path = common.CACHE / "models" / f"qwen2.5-{size.lower()}-shape"
    if (path / "config.json").exists():
        if _stale(path, size):  # its weights have another shape: rebuilding them is the user's call (GBs, minutes)
            raise SystemExit(f"{path} was built with another {size} shape than qwen_shapes.SHAPES: delete it and run again")
        return path
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg, tok = config(size)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(cfg).named_parameters()}
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    index, shard, shard_bytes, files = {}, {}, 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, files
        files += 1
        name = f"model-{files:05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
        shard, shard_bytes = {}, 0

    for name, shape in shapes.items():  # a tied head is listed once (as embed_tokens)
        t = torch.ones(shape) if "norm" in name else torch.randn(shape, generator=g) * 0.02
        shard[name] = t.to(torch.bfloat16)
        shard_bytes += shard[name].numel() * 2
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    total = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": index}, indent=1))
    cfg.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    return path
