"""Tiny random-weight causal LMs and a real fast tokenizer, built offline in seconds.

Used by the tests, the demo and the CPU benchmarks: no download ever happens. The tokenizer is a
byte-level BPE (digits split one by one, as Qwen2's) trained with `tokenizers` on a small synthetic
corpus, saved as a `PreTrainedTokenizerFast` with a chat template; the models are Hugging Face
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `LlamaForCausalLM`, `MistralForCausalLM` or the mixture of
experts `Qwen3MoeForCausalLM` with GQA, tied or untied word embeddings, saved with `save_pretrained`
(safetensors), so `transformers` and `vllm` load them like any Hub checkpoint.

    python -m hybrid_rl.model.tiny OUT_DIR --arch qwen2 --hidden 128 --layers 2
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

import torch

ARCHS = ("qwen2", "qwen3", "llama", "mistral", "qwen3_moe")  # Hugging Face's Qwen2/Qwen3/Llama/Mistral/Qwen3MoeForCausalLM
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "the answer is what how many plus minus times sum of and a an to is are we have total each "
    "add subtract multiply divide number numbers question solve think step first then so result "
    "apples oranges books cars students has had gives buys sells left more less than equal value"
).split()


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model. head_dim = hidden / heads must be one vLLM's CPU attention supports (>= 32)."""

    arch: str = "qwen2"
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    tie_embeddings: bool = False
    max_positions: int = 1024
    vocab_size: int = 512
    seed: int = 0
    # Mixture of experts (qwen3_moe only): every layer sparse, `experts` experts of width `moe_intermediate`, top-k.
    experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 64


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*", "="])
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(f"{words} {a} {op} {b} = ? The answer is \\boxed{{{a + b}}}. #### {a - b}")
    return lines


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE tokenizer with special tokens and a chat template (a `PreTrainedTokenizerFast`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(3000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _hf_config(spec: TinySpec, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=spec.tie_embeddings,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=eos_id,
        rms_norm_eps=1e-6,
        dtype="float32",
    )
    if spec.arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if spec.arch == "qwen3":
        return Qwen3Config(**common, head_dim=spec.hidden // spec.heads)
    if spec.arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=spec.hidden // spec.heads, num_experts=spec.experts,
                              num_experts_per_tok=spec.top_k, moe_intermediate_size=spec.moe_intermediate,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if spec.arch == "llama":
        return LlamaConfig(**common)
    if spec.arch == "mistral":
        return MistralConfig(**common, sliding_window=None, head_dim=spec.hidden // spec.heads)
    raise ValueError(f"tiny model arch must be one of {', '.join(ARCHS)}; got {spec.arch!r}")


def build_tiny_model(out_dir: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Write a random-weight model + tokenizer folder to `out_dir` and return its path."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, spec.seed)
    config = _hf_config(spec, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # A wider init than HF's 0.02 so random tiny models produce varied (not constant) greedy text.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # 3-D: a mixture of experts' fused expert weights
                p.normal_(0.0, 0.08 if "embed" in name or "lm_head" in name else 0.05)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--arch", default="qwen2", choices=ARCHS)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    spec = TinySpec(
        arch=a.arch, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
        intermediate=a.intermediate, tie_embeddings=a.tie_embeddings, seed=a.seed, experts=a.experts,
        top_k=a.top_k,
    )
    print(build_tiny_model(a.out_dir, spec))


if __name__ == "__main__":
    main()
