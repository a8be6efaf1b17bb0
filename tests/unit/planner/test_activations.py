"""Activations: the planner's estimate against the measured peak of the real packed passes.

Measured with `torch.distributed._tools.mem_tracker.MemTracker`, which follows every tensor the
passes allocate (on CPU too) and reports the peak of activations and temporaries. The estimate
must lie within LOW..HIGH of the measurement. It is allowed to be further above than below: it
is for planning, and a checkpointed backward is where it is loosest (it assumes one block's
recompute and its backward temporaries are alive together). Measured on these models the ratios
run from 0.97 to 1.35.
"""

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from hybrid_rl.model.forward import micro_batches, policy_logprobs, token_values
from hybrid_rl.model.loading import enable_activation_checkpointing, load_causal_lm, load_config, load_critic
from hybrid_rl.planner.activations import forward_activations, train_activations
from hybrid_rl.planner.param_count import ArchDims
from hybrid_rl.types import MATH_MAX_LEN, Sample

LOW, HIGH = 0.90, 1.40  # predicted / measured
# One packed micro-batch: ~2k tokens of sequences longer than MATH_MAX_LEN, or ~1.9k of sequences up to it (on CPU
# those run SDPA's math kernel, which saves more for backward: `math_len`).
RESPONSE_LENGTHS = {"long": (120, 200, 300, 400, 500, 300), "short": (112, 40, 80, 112, 96, 60) * 3}
PROMPT = 16


def _micro_batch(vocab: int, lengths: tuple[int, ...]):
    g = torch.Generator().manual_seed(0)
    samples = [Sample(i, torch.randint(0, vocab, (PROMPT,), generator=g), torch.randint(0, vocab, (n,), generator=g),
                      torch.zeros(n), False, i, i, {}) for i, n in enumerate(lengths)]
    return micro_batches(samples, token_budget=10**6)[0]


def _measured_activation_bytes(model, mb, *, train: bool, critic: bool = False) -> int:
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        if critic:
            token_values(model, mb).sum().backward()
        elif train:
            lp, ent = policy_logprobs(model, mb, temperature=1.0, with_entropy=True)
            (lp.sum() + ent.sum()).backward()
        else:
            with torch.no_grad():
                policy_logprobs(model, mb, temperature=1.0)
    peak = tracker.get_tracker_snapshot("peak")
    model.zero_grad(set_to_none=True)
    return sum(v for dev in peak.values() for k, v in dev.items() if str(k).endswith(("ACT", "TEMP")))


@pytest.mark.parametrize(("name", "dtype", "lengths"), [
    *((n, d, "long") for n in ["qwen2", "llama_tied_kv1", "qwen3", "mid"] for d in [torch.bfloat16, torch.float32]),
    ("qwen2", torch.bfloat16, "short"), ("mid", torch.bfloat16, "short"), ("qwen3", torch.float32, "short"),
    ("qwen3_moe", torch.bfloat16, "long"), ("qwen3_moe", torch.float32, "long")])
def test_activation_estimate_bounds_the_measured_peak(tiny_models, name, dtype, lengths):
    path = tiny_models[name]
    dims = ArchDims.from_hf_config(load_config(path))
    mb = _micro_batch(dims.vocab_size, RESPONSE_LENGTHS[lengths])
    tokens, responses = mb.packed.input_ids.numel(), sum(RESPONSE_LENGTHS[lengths])
    b = torch.finfo(dtype).bits // 8
    model = load_causal_lm(path).to(dtype)
    cases = {"no grad": (forward_activations(dims, tokens, b=b, attention="sdpa", responses=responses), False)}
    # Math-kernel sequences' score rows, per token: their token-weighted mean length (the plan passes the longest
    # sequence's, an upper bound).
    seqs = [n + PROMPT for n in RESPONSE_LENGTHS[lengths]]
    math_len = round(sum(n * n for n in seqs) / sum(seqs)) if max(seqs) <= MATH_MAX_LEN else 0
    cases["train"] = (train_activations(dims, tokens, b=b, attention="sdpa", checkpointing=False,
                                        responses=responses, math_len=math_len), True)
    measured = {k: _measured_activation_bytes(model, mb, train=t) for k, (_, t) in cases.items()}
    enable_activation_checkpointing(model)
    cases["train, checkpointed"] = (train_activations(dims, tokens, b=b, attention="sdpa", checkpointing=True,
                                                      responses=responses, math_len=math_len), True)
    measured["train, checkpointed"] = _measured_activation_bytes(model, mb, train=True)
    ratios = {case: round(predicted.total / measured[case], 3) for case, (predicted, _) in cases.items()}
    # Short sequences, checkpointed: the estimate keeps a whole block's saved tensors as backward's transient, more
    # than the measured peak of a block recomputed with the math kernel (measured 1.48 on "mid": an over-estimate).
    high = {"train, checkpointed": 1.5} if lengths == "short" else {}
    assert all(LOW <= r <= high.get(case, HIGH) for case, r in ratios.items()), ratios
    # Checkpointing is real (on 2-layer models the vocabulary tensors, which it cannot drop, dominate).
    assert measured["train, checkpointed"] < 0.75 * measured["train"]


def test_the_cpu_plan_counts_the_math_kernel_for_short_sequences_and_the_gpu_plan_does_not(tiny_models):
    from hybrid_rl.config import load_config as load_recipe
    from hybrid_rl.plan_inputs import plan_for
    from hybrid_rl.planner.inputs import DeviceSpec

    def update_activations(max_new_tokens: int, device: str) -> tuple[int, int, int]:
        cfg = load_recipe("grpo", [f"model.path={tiny_models['qwen2']}", "data.train_files=[/x.jsonl]",
                                   "data.max_prompt_tokens=32", f"rollout.max_new_tokens={max_new_tokens}",
                                   "trainer.prefix_share=false"])  # auto differs by device: only the kernel may
        plan = plan_for(cfg, 2, device=DeviceSpec(device, 64 * 2**30), attention="sdpa")
        item = next(i for i in plan.phase("update").items if i.component == "actor" and "activations" in i.what)
        x = plan.inputs
        return item.bytes, x.math_len, x.update_tokens

    dims = ArchDims.from_hf_config(load_config(tiny_models["qwen2"]))
    cpu, math_len, tokens = update_activations(64, "cpu")
    gpu, gpu_math_len, _ = update_activations(64, "cuda")
    assert math_len == 32 + 64 and gpu_math_len == 0
    per_token = 4 * dims.num_heads * (3 * dims.head_dim + 2 * math_len)  # layer_saved_per_token's math term
    assert cpu - gpu == dims.num_layers * tokens * per_token
    assert update_activations(4 * MATH_MAX_LEN, "cpu")[1] == MATH_MAX_LEN  # longer sequences: capped at the bound


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_critic_activation_estimate_bounds_the_measured_peak_with_and_without_checkpointing(tiny_models, dtype):
    """The critic (a 1-output token head, no vocabulary tensors) trains with checkpointing too when
    `model.activation_checkpointing` is on (`build._critic`), and the plan counts it so."""
    path = tiny_models["mid"]
    dims = ArchDims.from_hf_config(load_config(path))
    mb = _micro_batch(dims.vocab_size, RESPONSE_LENGTHS["long"])
    tokens = mb.packed.input_ids.numel()
    b = torch.finfo(dtype).bits // 8
    critic = load_critic(path).to(dtype)
    measured, ratios = {}, {}
    for ckpt in (False, True):
        if ckpt:
            enable_activation_checkpointing(critic)
        measured[ckpt] = _measured_activation_bytes(critic, mb, train=True, critic=True)
        predicted = train_activations(dims, tokens, b=b, attention="sdpa", checkpointing=ckpt, head="value")
        ratios[ckpt] = round(predicted.total / measured[ckpt], 3)
    assert all(LOW <= r <= HIGH for r in ratios.values()), ratios
    assert measured[True] < 0.5 * measured[False], measured  # no vocabulary tensors: checkpointing drops most
