"""Where each Hugging Face weight lives in vLLM's tensor-parallel model.

vLLM fuses `q/k/v_proj` into `qkv_proj` and `gate/up_proj` into `gate_up_proj`, a mixture of experts'
per-expert `gate/up_proj` into one `experts.routed_experts.w13_weight` [E, 2I/tp, H] (each expert's gate half, then its up half,
each split over the TP ranks on its own) and `down_proj` into `...w2_weight` [E, H, I/tp], splits linear
layers column- or row-wise over the TP ranks, replicates KV heads when there are fewer of them than
TP ranks (GQA), and pads the vocabulary to a multiple of 64 before splitting it. This module
encodes those rules per architecture as plain data, so the resharder can compute, for every rank,
exactly which rows or columns of every weight it needs, and where they go in vLLM's parameter.

Pure: no vLLM import. `tests/engine/test_layout_vs_vllm.py` checks these slices against vLLM's own
loader applied to the same full weights.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from hybrid_rl.model.families import family_of, fused_owner

Split = Literal["column", "kv_column", "row", "vocab", "replicate"]

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class ModelDims:
    """The few config numbers the layout depends on."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    num_experts: int = 0  # a mixture of experts (model.families); 0: dense
    moe_intermediate_size: int = 0

    @classmethod
    def from_hf_config(cls, config) -> ModelDims:
        archs = getattr(config, "architectures", None) or [type(config).__name__]
        heads = config.num_attention_heads
        return cls(
            architecture=archs[0],
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            num_experts=family_of(config).num_experts(config),
            moe_intermediate_size=getattr(config, "moe_intermediate_size", None) or 0,
        )


@dataclass(frozen=True)
class Rule:
    """How one family of HF weights maps onto vLLM: split kind, vLLM name and fused part."""

    pattern: re.Pattern[str]
    split: Split
    vllm_name: str  # a `re.sub` template applied to the HF name
    part: str | None = None  # which block of a fused vLLM parameter ("q", "k", "v", "gate", "up"; experts: "w1",
    # "w3", "w2", where group 2 of the pattern is the expert and vLLM's parameter is [E, ...], seen as [E * rows, ...])


def _rule(pattern: str, split: Split, vllm_name: str | None = None, part: str | None = None) -> Rule:
    return Rule(re.compile(pattern), split, vllm_name or r"\g<0>", part)


_LAYER = r"model\.layers\.(\d+)\."
# Dense decoder-only transformers in the Llama family (Llama, Mistral, Qwen2, Qwen3): same tensor names,
# optional q/k/v biases (Qwen2) and q/k norms (Qwen3).
_DECODER_RULES: tuple[Rule, ...] = (
    _rule(r"model\.embed_tokens\.weight", "vocab"),
    _rule(r"lm_head\.weight", "vocab"),
    _rule(_LAYER + r"self_attn\.q_proj\.(weight|bias)", "column", r"model.layers.\1.self_attn.qkv_proj.\2", "q"),
    _rule(_LAYER + r"self_attn\.k_proj\.(weight|bias)", "kv_column", r"model.layers.\1.self_attn.qkv_proj.\2", "k"),
    _rule(_LAYER + r"self_attn\.v_proj\.(weight|bias)", "kv_column", r"model.layers.\1.self_attn.qkv_proj.\2", "v"),
    _rule(_LAYER + r"self_attn\.o_proj\.weight", "row"),
    _rule(_LAYER + r"mlp\.gate_proj\.weight", "column", r"model.layers.\1.mlp.gate_up_proj.weight", "gate"),
    _rule(_LAYER + r"mlp\.up_proj\.weight", "column", r"model.layers.\1.mlp.gate_up_proj.weight", "up"),
    _rule(_LAYER + r"mlp\.down_proj\.weight", "row"),
    _rule(_LAYER + r"(input_layernorm|post_attention_layernorm)\.weight", "replicate"),
    _rule(_LAYER + r"self_attn\.(q_norm|k_norm)\.weight", "replicate"),
    _rule(r"model\.norm\.weight", "replicate"),
)

_EXPERT = _LAYER + r"mlp\.experts\.(\d+)\."
# Qwen3-MoE: the dense decoder's attention and norms, a replicated router, experts in vLLM's FusedMoE parameters.
_QWEN3_MOE_RULES: tuple[Rule, ...] = (
    *(r for r in _DECODER_RULES if "mlp" not in r.pattern.pattern),
    _rule(_LAYER + r"mlp\.gate\.weight", "replicate"),
    _rule(_EXPERT + r"gate_proj\.weight", "column", r"model.layers.\1.mlp.experts.routed_experts.w13_weight", "w1"),
    _rule(_EXPERT + r"up_proj\.weight", "column", r"model.layers.\1.mlp.experts.routed_experts.w13_weight", "w3"),
    _rule(_EXPERT + r"down_proj\.weight", "row", r"model.layers.\1.mlp.experts.routed_experts.w2_weight", "w2"),
)
EXPERT_PARTS = ("w1", "w3", "w2")

ARCHITECTURES: dict[str, tuple[Rule, ...]] = {
    "Qwen3MoeForCausalLM": _QWEN3_MOE_RULES,
    "Qwen2ForCausalLM": _DECODER_RULES,
    "Qwen3ForCausalLM": _DECODER_RULES,
    "LlamaForCausalLM": _DECODER_RULES,
    "MistralForCausalLM": _DECODER_RULES,
}


def check_architecture(architecture: str) -> None:
    """Raise a ValueError naming the architecture if the resharder has no layout for it."""
    if architecture not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(
            f"model architecture {architecture!r} has no weight layout for resharding into vLLM; "
            f"supported: {known}. Add its rules to hybrid_rl/weightsync/layout.py::ARCHITECTURES."
        )


@dataclass(frozen=True)
class TPSlice:
    """The part of one HF weight a TP rank holds, and where it goes in vLLM's local parameter.

    `dim`/`start`/`stop` select the HF rows (dim 0) or columns (dim 1); dim None = the whole tensor.
    `dest_offset` is the first row of that block inside vLLM's (possibly fused) local parameter.
    """

    hf_name: str
    vllm_name: str
    module: str  # vLLM module owning the parameter: fused weights of one module load together
    split: Split
    full_shape: tuple[int, ...]
    dim: int | None
    start: int
    stop: int
    dest_offset: int

    @property
    def shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        s = list(self.full_shape)
        s[self.dim] = self.stop - self.start
        return tuple(s)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _even(n: int, tp: int, name: str) -> int:
    if n % tp:
        raise ValueError(f"{name}: size {n} is not divisible by rollout.tp={tp}")
    return n // tp


class Layout:
    """Per-model, per-TP-size slicing rules: `slice(hf_name, tp_rank)` for every trainable weight."""

    def __init__(self, dims: ModelDims, tp: int):
        check_architecture(dims.architecture)
        self.dims, self.tp = dims, tp
        self.rules = ARCHITECTURES[dims.architecture]
        if dims.num_kv_heads < tp and tp % dims.num_kv_heads:
            raise ValueError(
                f"rollout.tp={tp} must divide or be a multiple of the model's {dims.num_kv_heads} KV heads"
            )
        _even(dims.num_heads, tp, "num_attention_heads")
        d = dims
        self._q_local = d.num_heads * d.head_dim // tp
        self._kv_local = max(d.num_kv_heads // tp, 1) * d.head_dim
        self._i_local = _even(d.intermediate_size, tp, "intermediate_size")
        self._part_offset = {"q": 0, "k": self._q_local, "v": self._q_local + self._kv_local, "gate": 0,
                             "up": self._i_local, None: 0}
        if d.num_experts:
            self._e_local = _even(d.moe_intermediate_size, tp, "moe_intermediate_size")
            self._part_offset.update(w1=0, w3=self._e_local, w2=0)
            # Rows of one expert in vLLM's [E, rows, cols] parameter seen as [E * rows, cols]
            self._expert_rows = {"w1": 2 * self._e_local, "w3": 2 * self._e_local, "w2": d.hidden_size}

    def rule_for(self, hf_name: str) -> tuple[Rule, str]:
        for rule in self.rules:
            if rule.pattern.fullmatch(hf_name):
                return rule, rule.pattern.sub(rule.vllm_name, hf_name)
        raise ValueError(f"weight {hf_name!r} of {self.dims.architecture} has no resharding rule")

    def skip(self, hf_name: str) -> bool:
        """Weights vLLM does not load separately (a tied lm_head shares the embedding)."""
        return self.dims.tie_word_embeddings and hf_name == "lm_head.weight"

    def slice(self, hf_name: str, full_shape: tuple[int, ...], tp_rank: int) -> TPSlice:
        rule, vllm_name = self.rule_for(hf_name)
        module = vllm_name.rsplit(".", 1)[0]
        dim, start, stop = self._range(rule.split, full_shape, tp_rank, hf_name)
        offset = self._part_offset[rule.part]
        if rule.part in EXPERT_PARTS:
            offset += self.expert_of(hf_name) * self._expert_rows[rule.part]
        return TPSlice(hf_name, vllm_name, module, rule.split, tuple(full_shape), dim, start, stop, offset)

    def expert_of(self, hf_name: str) -> int:
        """The expert a per-expert weight belongs to (its rule's group 2)."""
        rule, _ = self.rule_for(hf_name)
        return int(rule.pattern.fullmatch(hf_name).group(2))

    def held_rows(self, hf_name: str, shape: tuple[int, ...], world: int) -> list[tuple[int, int]] | None:
        """Rows of a per-expert weight each rank holds when the trainer shards its fused [E, ...] tensor along
        the experts (FSDP2's Shard(0)): all of them on the expert's rank, none elsewhere; None for any other
        weight (its own rows are sharded)."""
        rule, _ = self.rule_for(hf_name)
        if rule.part not in EXPERT_PARTS:
            return None
        owner = fused_owner(self.expert_of(hf_name), self.dims.num_experts, world)
        return [(0, shape[0]) if r == owner else (shape[0], shape[0]) for r in range(world)]

    def _range(self, split: Split, shape: tuple[int, ...], t: int, name: str) -> tuple[int | None, int, int]:
        if split == "replicate":
            return None, 0, shape[0]
        if split == "row":
            n = _even(shape[1], self.tp, name)
            return 1, t * n, (t + 1) * n
        if split == "column":
            n = _even(shape[0], self.tp, name)
            return 0, t * n, (t + 1) * n
        if split == "kv_column":
            d = self.dims
            if d.num_kv_heads >= self.tp:
                n = _even(shape[0], self.tp, name)
                return 0, t * n, (t + 1) * n
            head = t // (self.tp // d.num_kv_heads)  # KV heads replicated over tp/num_kv_heads ranks
            return 0, head * d.head_dim, (head + 1) * d.head_dim
        if split == "vocab":
            padded = -(-shape[0] // VOCAB_PADDING) * VOCAB_PADDING
            per = _even(padded, self.tp, name + " (padded vocab)")
            return 0, min(t * per, shape[0]), min((t + 1) * per, shape[0])
        raise AssertionError(split)

    def local_param_rows(self, vllm_name: str, full_rows: int) -> int:
        """Row count of vLLM's local parameter (fused blocks added up), for allocating test doubles."""
        if ".qkv_proj." in vllm_name:
            return self._q_local + 2 * self._kv_local
        if ".gate_up_proj." in vllm_name:
            return 2 * self._i_local
        if vllm_name.endswith(".routed_experts.w13_weight"):
            return self.dims.num_experts * 2 * self._e_local
        if vllm_name.endswith(".routed_experts.w2_weight"):
            return self.dims.num_experts * self.dims.hidden_size
        return full_rows
