"""Supervised warm-up of the demo's tiny model: teach the answer *format* only (see `task.py`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from hybrid_rl.data import pack
from hybrid_rl.demo.task import numbers_of, warmup_target
from hybrid_rl.model.loading import attn_implementation


def supervised_warmup(model_dir: str | Path, train_file: str | Path, out_dir: str | Path, *, epochs: int = 3,
                      batch_size: int = 16, lr: float = 2e-3, seed: int = 0, log=print) -> Path:
    """Fine-tune on (prompt, random boxed number from the prompt) pairs; save a HF folder to out_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    # the packed attention: each sequence of a packed batch alone, not transformers' T x T masked SDPA (whose
    # backward was 0.09 s a step of this 2-layer model, most of the warm-up)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=attn_implementation())
    rows = [json.loads(line) for line in open(train_file)]
    for r in rows:
        r["numbers"] = numbers_of(r["prompt"])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for epoch in range(epochs):
        rng.shuffle(rows)
        total = 0.0
        for i in range(0, len(rows) - batch_size + 1, batch_size):
            batch = rows[i : i + batch_size]
            prompts = [tok(r["prompt"]).input_ids for r in batch]
            answers = [tok(warmup_target(r, rng)).input_ids + [tok.eos_token_id] for r in batch]
            packed = pack([p + a for p, a in zip(prompts, answers, strict=True)])
            idx = packed.response_index([len(p) for p in prompts], [len(a) for a in answers])
            logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                           packed_seq_lens=tuple(packed.seq_lens)).logits[0]
            loss = torch.nn.functional.cross_entropy(logits[idx.logit_positions],
                                                     packed.input_ids[0, idx.target_positions])
            loss.backward()
            opt.step()
            opt.zero_grad()
            total += loss.item()
        log(f"warm-up epoch {epoch + 1}/{epochs}: loss {total / max(1, len(rows) // batch_size):.3f}")
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
