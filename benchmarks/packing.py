"""Packed, token-budget micro-batches vs. padded micro-batches of the same sequences: forward+backward tokens/s.

    python benchmarks/packing.py [--quick] [--size 4M] [--sequences 64] [--max-len 512] \\
        [--budgets 1024 2048 4096 8192] [--dtype float32]

One process. A batch of sequences whose lengths are drawn uniformly from 16 to --max-len (a quarter
of each, at most 64 tokens, is prompt). Each side runs forward + backward of the policy log-prob
loss over the whole batch, as the update does (no optimizer step: the same for both sides):

* packed: `hybrid_rl.model.forward.micro_batches(samples, budget)` + `policy_logprobs`, for each
  token budget in --budgets (the trainer's `trainer.micro_batch_tokens`, default 8192);
* padded: the same sequences in their order, `budget_default // max_len` per micro-batch (the same
  token budget as the default, counted in padded tokens), right-padded to the longest of each
  micro-batch with an attention mask (`hybrid_rl.data.pad` + `forward_logprobs`).

Rounds alternate every side (padded, packed@b1, packed@b2, ...); figures are medians of real
(unpadded) tokens/s. Target: packed >= 1.5x padded (at the default budget and at the best one).
On CPU, packed attention is SDPA with a block-diagonal [N, N] mask over the whole pack, so its cost
grows with the square of the *pack* length: the budget sweep shows the best budget for this machine.
Writes benchmarks/results/packing.json.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TARGET = 1.5
DEFAULT_BUDGET = 8192  # TrainerConfig.micro_batch_tokens


def make_samples(count: int, max_len: int, vocab: int, seed: int = 0):
    import torch

    from hybrid_rl.types import Sample

    rng = random.Random(seed)
    out = []
    for i in range(count):
        length = rng.randint(16, max_len)
        prompt = min(64, length // 4)
        ids = [rng.randrange(4, vocab) for _ in range(length)]
        out.append(Sample(i, torch.tensor(ids[:prompt]), torch.tensor(ids[prompt:]), torch.zeros(0), False, i, i, {}))
    return out


def packed_pass(model, samples, budget: int) -> int:
    from hybrid_rl.model.forward import micro_batches, policy_logprobs

    tokens = 0
    for mb in micro_batches(samples, budget):
        logp = policy_logprobs(model, mb, temperature=1.0)
        (-logp.sum() / logp.numel()).backward()
        tokens += mb.packed.num_tokens
    return tokens  # real tokens: packing adds none


def padded_pass(model, samples, per_micro: int, pad_id: int) -> int:
    import torch

    from hybrid_rl.data import pad
    from hybrid_rl.model.logprobs import forward_logprobs

    tokens = 0
    for i in range(0, len(samples), per_micro):
        chunk = samples[i : i + per_micro]
        ids, mask, pos = pad([torch.cat([s.prompt_ids, s.response_ids]) for s in chunk], pad_id)
        targets = torch.roll(ids, -1, 1)
        lp = forward_logprobs(model, ids, pos, targets, attention_mask=mask)
        keep = torch.zeros_like(mask, dtype=torch.bool)
        for j, s in enumerate(chunk):  # the response tokens, as the packed side scores them
            keep[j, s.prompt_len - 1 : s.length - 1] = True
        (-(lp * keep).sum() / keep.sum()).backward()
        tokens += ids.numel()  # padded tokens, the work this side does
    return tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="24 sequences, budgets 1024 2048 8192, 2 rounds (~2 min)")
    p.add_argument("--size", default="4M", choices=sorted(common.SIZES))
    p.add_argument("--sequences", type=int, help="default 24 quick, 96 full")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--budgets", nargs="+", type=int, help="packed token budgets (default 1024 2048 8192 quick, 512 1024 2048 4096 8192 full)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and compute (float32: this CPU has no native bf16 matmul)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a rank's count)")
    p.add_argument("--repeats", type=int, help="alternating rounds (default 2 quick, 5 full)")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP)
    a = p.parse_args()
    if a.smoke:
        a.sequences, a.max_len, a.budgets, a.repeats = 4, 64, [256], 1
    from hybrid_rl.utils.env import set_runtime_defaults

    set_runtime_defaults()
    import torch

    from hybrid_rl.model.loading import DTYPES, load_causal_lm, load_tokenizer

    torch.set_num_threads(a.threads)
    count = a.sequences or (24 if a.quick else 96)
    repeats = a.repeats or (2 if a.quick else 5)
    budgets = a.budgets or ([1024, 2048, 8192] if a.quick else [512, 1024, 2048, 4096, 8192])
    path = common.sized_model(a.size)
    model = load_causal_lm(str(path), dtype=DTYPES[a.dtype])
    model.config.use_cache = False
    pad_id = load_tokenizer(str(path)).pad_token_id
    samples = make_samples(count, a.max_len, model.config.vocab_size)
    real = sum(s.length for s in samples)
    per_micro = max(1, DEFAULT_BUDGET // a.max_len)

    def side(fn):
        def run():
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            fn()
            return real / (time.perf_counter() - t)

        return run

    sides = {"padded": side(lambda: padded_pass(model, samples, per_micro, pad_id))}
    for b in budgets:
        sides[f"packed@{b}"] = side(lambda b=b: packed_pass(model, samples, b))
    padded_tokens = padded_pass(model, samples, per_micro, pad_id)  # warm-up, and the padded token count
    packed_pass(model, samples, min(budgets))  # warm-up (the large budgets are slow: one pass each is enough)
    runs = common.alternate(sides, repeats)  # tokens/s (real tokens)
    base = common.median(runs["padded"])
    rows = [{"side": "padded", "budget": per_micro * a.max_len, "tok_s": base, "ratio": 1.0,
             "note": f"{per_micro} seqs/micro-batch, {padded_tokens} tokens incl. padding"}]
    from hybrid_rl.data import split_by_token_budget

    for b in budgets:
        groups = split_by_token_budget([s.length for s in samples], b)
        med = common.median(runs[f"packed@{b}"])
        rows.append({"side": f"packed@{b}", "budget": b, "tok_s": med, "ratio": med / base,
                     "note": f"{len(groups)} micro-batches, longest pack {max(sum(samples[i].length for i in g) for g in groups)}"})
    print(f"\nforward+backward over {count} sequences (lengths 16..{a.max_len}, {real} real tokens), "
          f"{a.size} model, {a.dtype}, {a.threads} thread(s); medians of {repeats} alternating rounds")
    print(common.table(rows, [("side", "side", "s"), ("tok_s", "tokens/s", ".0f"), ("ratio", "vs padded", ".2f"),
                              ("note", "", "s")]))
    best = max(rows[1:], key=lambda r: r["ratio"])
    default = next((r for r in rows if r["budget"] == DEFAULT_BUDGET and r["side"] != "padded"), None)
    targets = [common.check(f"packed@{best['budget']} (best) / padded", best["ratio"], TARGET, higher_is_better=True)]
    if default is not None:
        targets.append(common.check(f"packed@{DEFAULT_BUDGET} (default) / padded", default["ratio"], TARGET,
                                    higher_is_better=True))
    print(f"  best budget here: {best['budget']} tokens ({best['ratio']:.2f}x padded)"
          + (f"; default {DEFAULT_BUDGET}: {default['ratio']:.2f}x" if default else ""))
    common.write_result("packing", {"rows": rows, "samples": runs, "best_budget": best["budget"], "targets": targets,
                                    "settings": {"sequences": count, "max_len": a.max_len, "size": a.size,
                                                 "dtype": a.dtype, "threads": a.threads, "repeats": repeats,
                                                 "real_tokens": real, "padded_tokens": padded_tokens}},
                        quick=a.quick)


if __name__ == "__main__":
    main()
