"""Activation bytes of one packed micro-batch through a Hugging Face dense decoder. Pure arithmetic.

The counts follow what autograd actually saves in transformers' Llama/Qwen2/Qwen3 code (checked
tensor by tensor with `saved_tensors_hooks`), per token and per layer, with `b` the compute dtype's
bytes (FSDP mixed precision computes in `model.dtype`):

* each RMSNorm keeps a float32 copy of its input, a float32 rsqrt per row and the normalised input
  in `b` (its output is kept by the next linear layer);
* attention keeps q, k, v and the output (plus a float32 log-sum-exp per head), k and v at their
  own head count: flash-attn varlen on CUDA, and `model/attention.py`'s per-sequence SDPA ("sdpa"
  here) elsewhere (which builds no mask);
* the SwiGLU MLP keeps gate, act(gate), up and their product: 4 x intermediate x b;
* a mixture-of-experts layer (Qwen3-MoE, transformers' `grouped_mm` experts) runs each token through `top_k`
  experts, not all of them: per (token, selected expert) pair it keeps the gathered input [H], the expert's
  gate/up output [2I], act(gate) [I], their product [I] and the down projection's output that the routing weight
  multiplies [H], all in `b`, plus the pair's expert id and sort position (int64 each); per token the router's
  logits [E] in `b` and its float32 softmax [E]. So the experts cost `top_k x (2H + 4I) x b` per token, not
  `experts x ...`: the expert count enters only through the router's [E] rows.

The LM head runs only at the positions that predict response tokens (`logits_to_keep`), and
log-probs and entropies (`model/logprobs.py`) keep for backward only those logits, in the compute
dtype, and two floats per token; float32 exists one chunk (`LOGITS_CHUNK` positions) at a time. So
the vocabulary term is `responses x V x b` (twice in backward: the logits and their gradient) plus
a few float32 chunks. Without `responses` the estimate assumes every packed token is a response
token (an upper bound).

With activation checkpointing each block keeps only its input; backward recomputes one block at a
time. Sizes are upper bounds for the tensors that are alive together, not allocator-exact: the
tests hold them to the allocator's measured peak within the tolerance stated there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybrid_rl.planner.param_count import ArchDims

Attention = Literal["sdpa", "flash"]
LOGITS_CHUNK = 1024  # `logits_to_logprobs`' default chunk


@dataclass(frozen=True)
class ActivationBytes:
    """The parts of one micro-batch's activation memory, in bytes.

    `logits` and `transient` are never alive together (backward frees the vocabulary tensors before it
    reaches the blocks; a no-grad pass frees each block's intermediates before the head), so the peak
    is `layers + max(logits, transient)`.
    """

    layers: int  # what the blocks keep for backward (or their inputs when checkpointed) + model-level inputs
    logits: int  # vocabulary-sized tensors at their peak (the value / score head's are tiny)
    transient: int  # one block: its recompute and backward temporaries (grad), its live intermediates (no grad)

    @property
    def total(self) -> int:
        return self.layers + max(self.logits, self.transient)


def _norm(n: int, rows: int, b: int) -> int:
    """RMSNorm over `n` values in `rows` rows (per token): float32 copy, rsqrt, normalised copy."""
    return 4 * n + 4 * rows + b * n


def _mlp_saved(d: ArchDims, b: int, moe: bool) -> int:
    """Bytes a block's MLP (dense) or experts and router (`moe`) keep for backward, per token."""
    if not moe:
        return 4 * d.intermediate_size * b
    pairs = d.top_k * (b * (2 * d.hidden_size + 4 * d.moe_intermediate_size) + 16)
    return pairs + d.num_experts * (b + 4)


def _kinds(d: ArchDims) -> list[tuple[int, bool]]:
    """(how many layers, sparse?) for the model's dense and mixture-of-experts layers that exist."""
    return [(n, moe) for n, moe in ((d.dense_layers, False), (d.moe_layers, True)) if n]


def layer_saved_per_token(d: ArchDims, tokens: int, b: int, attention: Attention, math_len: int = 0, *,
                          moe: bool = False) -> int:
    """Bytes one decoder block (a sparse one with `moe`) saves for backward, per token.

    `math_len`: sequences up to this long run SDPA's math kernel (`model/attention.py`'s `MATH_MAX_LEN`, CPU), which keeps float32
    copies of q, k and v at every query head and two float32 score rows per head; counted for every token.
    """
    h, q = d.hidden_size, d.num_heads * d.head_dim
    attn = attention_row_bytes(d, b, attention, math_len)
    if d.qk_norm:
        attn += _norm(q, d.num_heads, b) + _norm(d.num_kv_heads * d.head_dim, d.num_kv_heads, b)
    norms_and_inputs = 2 * (_norm(h, 1, b) + b * h)  # two norms + their outputs kept by the next linear
    return norms_and_inputs + attn + _mlp_saved(d, b, moe)


def attention_row_bytes(d: ArchDims, b: int, attention: Attention, math_len: int = 0) -> int:
    """What one block's attention keeps for backward per row: q, k, v, output (the o_proj input) and log-sum-exp,
    and with the math kernel float32 q, k, v at every query head and two float32 score rows per head."""
    q = d.num_heads * d.head_dim
    attn = b * (2 * q + 2 * _kv_width(d, attention)) + 4 * d.num_heads
    return attn + (4 * d.num_heads * (3 * d.head_dim + 2 * math_len) if math_len else 0)


@dataclass(frozen=True)
class SharedRows:
    """Attention rows a prefix-shared micro-batch holds beyond its tokens (`model/attention.py`'s `tree_sdpa`): key
    rows (each branch attends to its group's prompt keys, copied once per branch) and padded query rows (a group's
    branches are padded to the longest, key and query)."""

    keys: int = 0
    queries: int = 0


def shared_extra_rows(tokens: int, n: int, longest: int, longest_response: int) -> SharedRows:
    """`SharedRows` of a micro-batch of `tokens` tokens in groups of `n`, samples up to `longest` tokens.

    A group of prompt p and n branches of R tokens in all (each at least one), the longest r, holds n (p + r) key
    rows for its p + R tokens: at most (n - 1)(L - 1) / (L + n - 1) more per token, L = p + r <= `longest` (a bound).
    Its padding, n r - R <= (n - 1)(r - 1) rows, is counted per token as if every prompt were as long as the longest
    sample's (an estimate: short prompts with one long response pad more per token)."""
    if n <= 1:
        return SharedRows()
    per = longest + n - 1
    return SharedRows(tokens * (n - 1) * (longest - 1) // per, tokens * (n - 1) * max(longest_response - 1, 0) // per)


def _shared_bytes(d: ArchDims, b: int, attention: Attention, math_len: int, rows: SharedRows) -> int:
    """One block's saved bytes for `rows`: a key row keeps k and v (and float32 copies at every query head with the
    math kernel), a padded query row what a token's attention keeps."""
    key = b * 2 * _kv_width(d, attention) + (8 * d.num_heads * d.head_dim if math_len else 0)
    return rows.keys * key + rows.queries * attention_row_bytes(d, b, attention, math_len)


def _kv_width(d: ArchDims, attention: Attention) -> int:
    """k/v width as attention sees it: both kernels take GQA's KV heads as they are."""
    return d.num_kv_heads * d.head_dim


def _model_level(d: ArchDims, tokens: int, b: int, attention: Attention) -> int:
    """Input ids, rotary cos/sin, the final norm and the head's input."""
    return tokens * (8 + 2 * d.head_dim * b + _norm(d.hidden_size, 1, b) + b * d.hidden_size)


def _block_backward(d: ArchDims, tokens: int, b: int) -> int:
    """Gradients alive while backward goes through one block (MLP and float32 residual-stream grads); a sparse
    block's are those of its `top_k` experts' pairs and of their gathered inputs and outputs."""
    mlp = max((3 * d.moe_intermediate_size * d.top_k * b // 2 + 2 * d.top_k * d.hidden_size * b) if moe
              else 3 * d.intermediate_size * b // 2 for _, moe in _kinds(d))
    return tokens * (mlp + 8 * d.hidden_size)


def _logits_grad(d: ArchDims, tokens: int, responses: int, b: int, entropy: bool) -> int:
    """Peak of the head under autograd: in backward, the saved response logits and their gradient (both
    `b`) plus one chunk's float32 working set (two buffers, updated in place)."""
    v, chunk = d.vocab_size, min(responses, LOGITS_CHUNK)
    return 2 * responses * v * b + 2 * chunk * v * 4


def _logits_no_grad(d: ArchDims, tokens: int, responses: int, b: int, entropy: bool) -> int:
    """The response logits (`b`) + one chunk's float32 working set (scaled log-probs; with entropies, their
    exponent too)."""
    v, chunk = d.vocab_size, min(responses, LOGITS_CHUNK)
    return responses * v * b + (2 if entropy else 1) * chunk * v * 4


def train_activations(d: ArchDims, tokens: int, *, b: int, attention: Attention, checkpointing: bool,
                      head: str = "lm", entropy: bool = True, responses: int | None = None,
                      math_len: int = 0, extra_rows: SharedRows = SharedRows()) -> ActivationBytes:
    """Peak activation memory of one forward + backward of a `tokens`-token packed micro-batch.

    `responses`: response tokens in it (default: all of them, an upper bound). `math_len`: as
    `layer_saved_per_token`'s. `extra_rows`: attention rows beyond the tokens (prefix sharing,
    `shared_extra_rows`).
    """
    responses = tokens if responses is None else responses
    per_layer = {moe: layer_saved_per_token(d, tokens, b, attention, math_len, moe=moe) * tokens
                 for _, moe in _kinds(d)}
    transient = _block_backward(d, tokens, b)
    if checkpointing:  # blocks keep their input; backward recomputes one block, then runs through it
        layers, transient = d.num_layers * tokens * d.hidden_size * b, transient + max(per_layer.values())
    else:
        layers = sum(n * per_layer[moe] for n, moe in _kinds(d))
    shared = _shared_bytes(d, b, attention, math_len, extra_rows)
    layers += 0 if checkpointing else d.num_layers * shared
    transient += shared if checkpointing else 0
    logits = _logits_grad(d, tokens, responses, b, entropy) if head == "lm" else tokens * 8
    return ActivationBytes(layers + _model_level(d, tokens, b, attention), logits, transient)


def forward_activations(d: ArchDims, tokens: int, *, b: int, attention: Attention, head: str = "lm",
                        entropy: bool = False, responses: int | None = None,
                        extra_rows: SharedRows = SharedRows()) -> ActivationBytes:
    """Peak activation memory of one no-grad forward (old log-probs, reference, critic values, reward scores).

    Nothing is saved: the residual stream and one block's intermediates are alive at a time, the
    larger of its attention (q, k, v, output) and its MLP (gate, act, up and their product; a sparse block's
    `top_k` experts' pairs and its router's rows, as `_mlp_saved` counts them).
    """
    responses = tokens if responses is None else responses
    h, q = d.hidden_size, d.num_heads * d.head_dim
    residual = tokens * (2 * h * b + 4 * h)  # the block's input, its normalised copy, the float32 norm copy
    attn = (tokens + extra_rows.queries) * b * 2 * q + (tokens + extra_rows.keys) * b * 2 * _kv_width(d, attention)
    block = max(attn, *(tokens * _mlp_saved(d, b, moe) for _, moe in _kinds(d)))
    logits = _logits_no_grad(d, tokens, responses, b, entropy) if head == "lm" else tokens * 8
    return ActivationBytes(residual + tokens * 2 * d.head_dim * b, logits, block)
