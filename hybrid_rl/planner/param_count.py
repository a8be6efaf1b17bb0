"""Every parameter's name and shape, from a model's `config.json` alone (no weights, no allocation).

The memory planner needs shapes, not just a count: FSDP2 pads dim 0 of each parameter to a multiple
of the world size before sharding it, so per-rank bytes depend on every shape. For the dense
decoders the trainer supports (Llama, Mistral, Qwen2, Qwen3) and Qwen3-MoE the shapes are written out from
the Hugging Face modelling code: embeddings, q/k/v/o with GQA and the biases the architecture has
(Qwen2: q/k/v; Llama/Qwen3: all four when `attention_bias`), the MLP (`mlp_bias` for Llama), the
norms, Qwen3's per-head q/k norms and an untied `lm_head` (a tied one is the embedding, counted
once, as `named_parameters()` does). A Qwen3-MoE sparse layer holds, instead of the MLP, its experts fused
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and its router (`mlp.gate` [E, H]). Any other architecture is instantiated on the meta device and
its parameters listed. `tests/unit/planner/` compares both paths with the real modules.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from hybrid_rl.types import Head

_BLOCK = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")  # Llama-style, GPT-2-style, others


@dataclass(frozen=True)
class ParamShape:
    name: str
    shape: tuple[int, ...]
    trainable: bool = True  # False: frozen (a LoRA base weight); no gradient, no optimizer state

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def block(self) -> int | None:
        """The transformer block this parameter belongs to (FSDP unit); None for the root (embeddings, head)."""
        m = _BLOCK.search(self.name)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ArchDims:
    """The config numbers that activation sizes depend on."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k
    # Mixture of experts (0 for dense models): experts per sparse layer, experts each token uses, one expert's
    # intermediate width, and how many of the layers are sparse (the others have the dense MLP).
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    moe_layers: int = 0

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    @classmethod
    def from_hf_config(cls, config) -> ArchDims:
        heads, hidden = config.num_attention_heads, config.hidden_size
        return cls(
            architecture=architecture_of(config),
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            # Other families name it differently (GPT-2: n_inner, None = 4 x hidden); activations only.
            intermediate_size=getattr(config, "intermediate_size", None) or 4 * hidden,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or hidden // heads,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=getattr(config, "model_type", "") in ("qwen3", "qwen3_moe"),
            num_experts=_num_experts(config),
            top_k=int(getattr(config, "num_experts_per_tok", 0) or 0) if _num_experts(config) else 0,
            moe_intermediate_size=int(getattr(config, "moe_intermediate_size", 0) or 0),
            moe_layers=len(sparse_layers(config)),
        )


def _num_experts(config) -> int:
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)


def sparse_layers(config) -> list[int]:
    """The layers whose MLP is a mixture of experts (Qwen3-MoE's rule: not in `mlp_only_layers`, and every
    `decoder_sparse_step`-th layer); none for a dense model."""
    if not _num_experts(config):
        return []
    step, dense = getattr(config, "decoder_sparse_step", 1) or 1, set(getattr(config, "mlp_only_layers", None) or ())
    return [n for n in range(config.num_hidden_layers) if n not in dense and (n + 1) % step == 0]


def is_expert(name: str) -> bool:
    """A routed expert's parameter (each token uses `top_k` of a layer's `num_experts`)."""
    return ".mlp.experts." in name


def active_numel(params, dims: ArchDims) -> int:
    """Parameters one token goes through: every parameter but the routed experts, and `top_k / num_experts` of
    those (for a dense model, all of them)."""
    experts = sum(p.numel for p in params if is_expert(p.name))
    rest = sum(p.numel for p in params) - experts
    return rest + (experts * dims.top_k // dims.num_experts if dims.num_experts else experts)


# Which biases each supported architecture's modelling code creates: (q/k/v, o_proj, MLP).
_BIASES = {
    "Qwen2ForCausalLM": lambda c: (True, False, False),
    "Qwen3ForCausalLM": lambda c: (c.attention_bias, c.attention_bias, False),
    "LlamaForCausalLM": lambda c: (c.attention_bias, c.attention_bias, c.mlp_bias),
    "MistralForCausalLM": lambda c: (False, False, False),
    "Qwen3MoeForCausalLM": lambda c: (c.attention_bias, c.attention_bias, False),
}
KNOWN_ARCHITECTURES = tuple(_BIASES)


def architecture_of(config) -> str:
    return (getattr(config, "architectures", None) or [type(config).__name__])[0]


def model_params(config, head: Head = "lm") -> list[ParamShape]:
    """Names and shapes of `AutoModelFor{CausalLM,TokenClassification,SequenceClassification}` (num_labels=1)."""
    if architecture_of(config) not in _BIASES:
        return meta_params(config, head)
    dims = ArchDims.from_hf_config(config)
    qkv_bias, o_bias, mlp_bias = _BIASES[dims.architecture](config)
    h, i, d = dims.hidden_size, dims.intermediate_size, dims.head_dim
    q, kv = dims.num_heads * d, dims.num_kv_heads * d
    out, sparse = [ParamShape("model.embed_tokens.weight", (dims.vocab_size, h))], set(sparse_layers(config))
    for n in range(dims.num_layers):
        p = f"model.layers.{n}."
        out += _linear(p + "self_attn.q_proj", h, q, qkv_bias)
        out += _linear(p + "self_attn.k_proj", h, kv, qkv_bias)
        out += _linear(p + "self_attn.v_proj", h, kv, qkv_bias)
        out += _linear(p + "self_attn.o_proj", q, h, o_bias)
        if dims.qk_norm:
            out += [ParamShape(p + "self_attn.q_norm.weight", (d,)), ParamShape(p + "self_attn.k_norm.weight", (d,))]
        if n in sparse:  # transformers' Qwen3MoeSparseMoeBlock: `experts` registered before `gate`
            e, ie = dims.num_experts, dims.moe_intermediate_size
            out += [ParamShape(p + "mlp.experts.gate_up_proj", (e, 2 * ie, h)),
                    ParamShape(p + "mlp.experts.down_proj", (e, h, ie)), ParamShape(p + "mlp.gate.weight", (e, h))]
        else:
            out += _linear(p + "mlp.gate_proj", h, i, mlp_bias)
            out += _linear(p + "mlp.up_proj", h, i, mlp_bias)
            out += _linear(p + "mlp.down_proj", i, h, mlp_bias)
        out += [ParamShape(p + "input_layernorm.weight", (h,)), ParamShape(p + "post_attention_layernorm.weight", (h,))]
    out.append(ParamShape("model.norm.weight", (h,)))
    return out + _head(config, head, dims)


def _linear(name: str, fan_in: int, fan_out: int, bias: bool) -> list[ParamShape]:
    w = [ParamShape(name + ".weight", (fan_out, fan_in))]
    return w + [ParamShape(name + ".bias", (fan_out,))] if bias else w


def _head(config, head: Head, dims: ArchDims) -> list[ParamShape]:
    if head == "lm":
        return [] if dims.tie_word_embeddings else [ParamShape("lm_head.weight", (dims.vocab_size, dims.hidden_size))]
    w = [ParamShape("score.weight", (1, dims.hidden_size))]
    # transformers' GenericForTokenClassification gives its score layer a bias unless the config says otherwise.
    if head == "value" and getattr(config, "token_classification_bias", True):
        w.append(ParamShape("score.bias", (1,)))
    return w


def lora_params(params: list[ParamShape], *, rank: int, target_modules: list[str]) -> list[ParamShape]:
    """The parameters of `peft.get_peft_model(model, LoraConfig(r=rank, target_modules=...))`, in peft's
    names and order: every base weight frozen, and after each targeted linear's own weight (and bias)
    a trainable `lora_A` [rank, in] and `lora_B` [out, rank]. A mixture's fused experts [E, out, in] named by the
    targets (`experts`, or `gate_up_proj` / `down_proj`: `model.lora.apply_lora`'s `target_parameters`) get one
    peft wrapper each, nested in their module, with `lora_A` [rank * E, in] and `lora_B` [out, rank * E]."""
    modules = {p.name.rpartition(".")[0]: p for p in params}  # module -> its last parameter
    experts: dict[str, list[ParamShape]] = {}  # module -> its adapted fused parameters, in order
    for p in params:
        module, _, leaf = p.name.rpartition(".")
        if len(p.shape) == 3 and (leaf in target_modules or module.rsplit(".", 1)[-1] in target_modules):
            experts.setdefault(module, []).append(p)
    out = []
    for p in params:
        module, _, leaf = p.name.rpartition(".")
        targeted = module.rsplit(".", 1)[-1] in target_modules and module not in experts
        nested = len(experts.get(module, ()))
        name = f"{module}.base_layer.{leaf}" if targeted else f"{module}{'.base_layer' * nested}.{leaf}"
        out.append(ParamShape("base_model.model." + name, p.shape, trainable=False))
        if targeted and modules[module] is p:
            fan_out, fan_in = next(q.shape for q in params if q.name == module + ".weight")
            out += [ParamShape(f"base_model.model.{module}.lora_A.default.weight", (rank, fan_in)),
                    ParamShape(f"base_model.model.{module}.lora_B.default.weight", (fan_out, rank))]
        if nested and modules[module] is p:  # the innermost wrapper (the module's first fused parameter) first
            for i, q in enumerate(experts[module]):
                wrapper = f"base_model.model.{module}{'.base_layer' * (nested - 1 - i)}"
                e, fan_out, fan_in = q.shape
                out += [ParamShape(f"{wrapper}.lora_A.default.weight", (rank * e, fan_in)),
                        ParamShape(f"{wrapper}.lora_B.default.weight", (fan_out, rank * e))]
    return out


def meta_params(config, head: Head = "lm") -> list[ParamShape]:
    """Instantiate the model on the meta device (no memory) and list its parameters."""
    import copy

    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    auto = {"lm": AutoModelForCausalLM, "value": AutoModelForTokenClassification,
            "score": AutoModelForSequenceClassification}[head]
    config = copy.deepcopy(config)
    if head != "lm":
        config.num_labels = 1
    with torch.device("meta"):
        model = auto.from_config(config)
    return [ParamShape(n, tuple(p.shape)) for n, p in model.named_parameters()]
