"""Supervised warm-up of the tools demo's tiny model on the call format (see `tools_task.py`).

Each conversation is laid out as token ids exactly as the multi-turn rollout will lay it out (`rollout.trajectory`):
the prompt, the model's turns each ended by its end-of-turn token, and between them the tool message as the chat
template's suffix (`chat_template.ToolSuffix`); the loss covers the model's tokens only, so the warm-up teaches what
RL will train, id for id.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from hybrid_rl.demo.tools_task import WarmupConversation, read_rows, warmup_conversation
from hybrid_rl.model.loading import attn_implementation
from hybrid_rl.rollout.chat_template import ToolSuffix, detect_family
from hybrid_rl.rollout.tools import resolve_tools


def conversation_ids(tok, suffix: ToolSuffix, conv: WarmupConversation) -> tuple[list[int], list[bool]]:
    """(ids, loss mask) of one conversation: mask 1 on the model's turns (with their end-of-turn token)."""
    prompt = tok.apply_chat_template([{"role": "user", "content": conv.question}], tokenize=False,
                                     add_generation_prompt=True)
    ids = list(tok(prompt, add_special_tokens=False)["input_ids"])
    mask = [False] * len(ids)
    for k, turn in enumerate(conv.model_turns):
        if k:
            context = suffix.ids([{"role": "tool", "name": "python", "content": conv.tool_output}], ended=True)
            ids += context
            mask += [False] * len(context)
        own = list(tok(turn, add_special_tokens=False)["input_ids"]) + [suffix.end_of_turn_id]
        ids += own
        mask += [True] * len(own)
    return ids, mask


def tools_warmup(model_dir: str | Path, train_file: str | Path, out_dir: str | Path, *, call_share: float,
                 steps: int, batch_size: int = 32, lr: float = 2e-3, seed: int = 0, log=print) -> Path:
    """`steps` AdamW steps on the warm-up mix (`call_share` of the conversations call the tool); save to out_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    suffix = ToolSuffix(tok, detect_family(tok.chat_template), [t.schema for t in resolve_tools(["python"])])
    # the packed attention: each sequence of a packed batch alone, not transformers' T x T masked SDPA (whose
    # backward was 0.09 s a step of this 2-layer model, most of the warm-up)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=attn_implementation())
    rows = read_rows(train_file)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps)
    model.train()
    total = 0.0
    for step in range(1, steps + 1):
        batch = [conversation_ids(tok, suffix, warmup_conversation(r, rng, call_share=call_share))
                 for r in rng.sample(rows, batch_size)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.int64)
        labels = torch.full_like(input_ids, -100)
        attention = torch.zeros_like(input_ids)
        for i, (ids, mask) in enumerate(batch):
            row = torch.tensor(ids)
            input_ids[i, : len(ids)] = row
            attention[i, : len(ids)] = 1
            labels[i, : len(ids)] = torch.where(torch.tensor(mask), row, -100)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        total += loss.item()
        if step % 100 == 0 or step == steps:
            log(f"tools warm-up step {step}/{steps}: loss {total / (100 if step % 100 == 0 else step % 100):.3f}")
            total = 0.0
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
