"""A short run on the demo's task with `adamw8bit` follows AdamW's loss curve closely (single process, seconds).

The demo's tiny model learns to answer the task's prompts (the boxed digit) from the same batches in the same
order with each optimizer; the 8-bit moments only add quantisation noise to the update.
"""

from __future__ import annotations

import random

import torch

from hybrid_rl.data import pack
from hybrid_rl.demo.task import make_row
from hybrid_rl.model.optimizers import build_optimizer
from hybrid_rl.model.tiny import TinySpec, build_tiny_model

STEPS, BATCH, LR = 30, 16, 2e-3


def _curve(model_dir, name: str) -> list[float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = build_optimizer(name, model.parameters(), lr=LR, betas=(0.9, 0.999))
    rng = random.Random(0)
    losses = []
    for _ in range(STEPS):
        rows = [make_row(rng) for _ in range(BATCH)]
        prompts = [tok(r["prompt"]).input_ids for r in rows]
        answers = [tok(f" \\boxed{{{r['ground_truth']}}}").input_ids + [tok.eos_token_id] for r in rows]
        packed = pack([p + a for p, a in zip(prompts, answers, strict=True)])
        idx = packed.response_index([len(p) for p in prompts], [len(a) for a in answers])
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits[0]
        loss = torch.nn.functional.cross_entropy(logits[idx.logit_positions], packed.input_ids[0, idx.target_positions])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_adamw8bit_loss_curve_follows_adamw(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", TinySpec())
    full, eight = _curve(model_dir, "adamw"), _curve(model_dir, "adamw8bit")
    assert full[-1] < 0.5 * full[0], f"AdamW did not learn: the comparison would be vacuous ({full[0]} -> {full[-1]})"
    assert eight != full  # really a different optimizer
    # Mean over windows of 5 steps (single batches are noisy): within 5% of AdamW's all along the run.
    for i in range(0, STEPS, 5):
        a, b = sum(full[i:i + 5]) / 5, sum(eight[i:i + 5]) / 5
        assert abs(b - a) <= 0.05 * a, (i, a, b, full, eight)
