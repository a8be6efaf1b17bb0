"""Helpers of `distill.py` in plain torch on CPU: batched greedy answers, the supervised warm-up (sequence-level KD:
the student is fine-tuned on the teacher's own greedy answers to the training prompts, so that OPD starts from a
student that writes text), and the held-out reverse KL of a student to the teacher."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path


def _bf16():
    """bf16 matmuls (the CPU's AVX512-BF16: about 4x float32 here), float32 weights and optimizer state."""
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16)


def _load(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = model.generation_config.eos_token_id or tok.eos_token_id
    return tok, model, set(eos if isinstance(eos, list) else [eos])


def _prompt_ids(tok, prompts: list[list[dict]]) -> list[list[int]]:
    return [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for p in prompts]


def _left_pad(rows: list[list[int]], pad: int):
    import torch

    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def cut_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    """(the tokens before the first EOS, whether there was one)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i], True
    return tokens, False


def greedy(model_dir: Path, prompts: list[list[dict]], max_new_tokens: int, batch: int = 16,
           keep_eos: bool = False) -> list[list[int]]:
    """Greedy answers (token ids; EOS and what follows cut, or EOS kept as the last token with `keep_eos`) with
    transformers, float32, `batch` prompts at a time, left-padded."""
    import torch

    tok, model, eos = _load(model_dir)
    model.eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos))
    out = []
    with torch.no_grad(), _bf16():
        for i in range(0, len(prompts), batch):
            ids, mask = _left_pad(_prompt_ids(tok, prompts[i:i + batch]), pad)
            gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad)[:, ids.shape[1]:]
            for row in gen.tolist():
                answer, stopped = cut_at_eos(row, eos)
                out.append(answer + [row[len(answer)]] if keep_eos and stopped else answer)
    return out


def sft_batches(prompt_ids: list[list[int]], answers: list[list[int]], batch: int, steps: int, seed: int):
    """`steps` batches of (prompt + answer) rows, drawn in seeded epochs; each row's labels mask its prompt."""
    rows = [(p, a) for p, a in zip(prompt_ids, answers, strict=True) if a]
    rng, order = random.Random(seed), []
    for _ in range(steps):
        if len(order) < batch:
            order += rng.sample(range(len(rows)), len(rows))
        yield [rows[j] for j in order[:batch]]
        del order[:batch]


def collate_left(rows: list[tuple[list[int], list[int]]], pad: int):
    """Left-padded (ids, mask, labels, keep): the answers end every row, so the logits of the last `keep` positions
    (the longest answer plus the one before it) are all the loss needs; labels are shifted to those positions."""
    import torch

    width = max(len(p) + len(a) for p, a in rows)
    keep = max(len(a) for _, a in rows) + 1
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), keep), -100)
    for i, (p, a) in enumerate(rows):
        seq = p + a
        ids[i, width - len(seq):] = torch.tensor(seq)
        mask[i, width - len(seq):] = 1
        labels[i, keep - 1 - len(a):keep - 1] = torch.tensor(a)  # logits at position j predict token j + 1
    return ids, mask, labels, keep


def warm_up(student: Path, out: Path, prompts: list[list[dict]], answers: list[list[int]], *, steps: int, lr: float,
            batch: int = 8, seed: int = 0) -> tuple[Path, list[dict]]:
    """Fine-tune `student` on (prompt, teacher answer) pairs with cross-entropy on the answer tokens (AdamW, constant
    lr, float32, seeded); save it with the student's tokenizer files to `out`. Returns (out, loss curve)."""
    import torch

    torch.manual_seed(seed)
    tok, model, eos = _load(student)
    model.train()
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    curve, t0 = [], time.perf_counter()
    for step, rows in enumerate(sft_batches(_prompt_ids(tok, prompts), answers, batch, steps, seed), 1):
        ids, mask, labels, keep = collate_left(rows, pad)
        with _bf16():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                           logits_to_keep=keep).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve.append({"step": step, "loss": loss.item(), "elapsed_s": time.perf_counter() - t0})
        if step == 1 or step % 25 == 0:
            print(f"  warm-up step {step}/{steps}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    for p in student.iterdir():  # tokenizer, chat template, generation config
        if p.is_file() and p.name != "config.json" and not p.name.startswith(("model", ".")):
            shutil.copy2(p, out / p.name)
    return out, curve


def heldout_kl(student: Path, teacher: Path, prompts: list[list[dict]], *, n: int, max_new_tokens: int,
               seed: int = 0) -> dict:
    """The student samples `n` answers a held-out prompt (temperature 1, seeded); on its own tokens, the mean per
    token of KL(student || teacher) over the whole vocabulary (`exact`) and of the sampled token's log-prob gap
    (`k1`, what `opd/reverse_kl` estimates in training, there sequence-mean)."""
    import torch

    tok, s_model, eos = _load(student)
    _, t_model, _ = _load(teacher)
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos))
    exact = k1 = count = 0.0
    torch.manual_seed(seed)
    with torch.no_grad(), _bf16():
        for p in _prompt_ids(tok, prompts):
            ids = torch.tensor([p] * n)
            gen = s_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                   temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                   pad_token_id=pad)
            resp = gen[:, len(p):]
            live = torch.ones_like(resp, dtype=torch.bool)  # tokens up to and including the first EOS
            for i, row in enumerate(resp.tolist()):
                answer, stopped = cut_at_eos(row, eos)
                live[i, len(answer) + int(stopped):] = False
            logp_s = torch.log_softmax(s_model(gen).logits[:, len(p) - 1:-1].float(), -1)
            logp_t = torch.log_softmax(t_model(gen).logits[:, len(p) - 1:-1].float(), -1)
            kl = (logp_s.exp() * (logp_s - logp_t)).sum(-1)
            gap = (logp_s - logp_t).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
            exact += kl[live].sum().item()
            k1 += gap[live].sum().item()
            count += live.sum().item()
    return {"exact": exact / count, "k1": k1 / count, "tokens": int(count)}


def teacher_forced(scorer: Path, prompts: list[list[dict]], answers: list[list[int]]) -> dict:
    """`scorer` reads each (prompt, answer) pair teacher-forced: on the answer's tokens, the share that are its own
    argmax given the same prefix (`argmax_agree`) and their mean log-prob (`logp`, nats per token); the same over the
    fresh tokens only (`*_fresh`: a token whose pair with the one before has not yet occurred in the answer), since a
    model predicts a loop it has seen, so repetition alone raises both. With the teacher as scorer and the student's
    greedy answers: how often the student's greedy choice is the teacher's choice at that point, and how likely the
    teacher finds the answer; with the student as scorer and the teacher's answers: the forward direction (the
    student's log-prob of what the teacher writes)."""
    import torch

    tok, model, _ = _load(scorer)
    model.eval()
    sums = dict.fromkeys(("agree", "logp", "count", "agree_fresh", "logp_fresh", "fresh"), 0.0)
    with torch.no_grad(), _bf16():
        for p, a in zip(_prompt_ids(tok, prompts), answers, strict=True):
            if not a:
                continue
            logits = model(torch.tensor([p + a])).logits[0, len(p) - 1:-1].float()
            target = torch.tensor(a)
            hit = logits.argmax(-1) == target
            logp = torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0]
            seen, fresh = set(), torch.zeros(len(a), dtype=torch.bool)
            for i, pair in enumerate(zip([None, *a[:-1]], a, strict=True)):
                fresh[i] = pair not in seen
                seen.add(pair)
            sums["agree"] += hit.sum().item()
            sums["logp"] += logp.sum().item()
            sums["count"] += len(a)
            sums["agree_fresh"] += hit[fresh].sum().item()
            sums["logp_fresh"] += logp[fresh].sum().item()
            sums["fresh"] += fresh.sum().item()
    n, f = max(sums["count"], 1.0), max(sums["fresh"], 1.0)
    return {"argmax_agree": sums["agree"] / n, "logp": sums["logp"] / n, "tokens": int(sums["count"]),
            "argmax_agree_fresh": sums["agree_fresh"] / f, "logp_fresh": sums["logp_fresh"] / f,
            "fresh_tokens": int(sums["fresh"])}
