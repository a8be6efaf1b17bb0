"""Speculative rollout against the policy: one rank, the hybrid engine (FSDP policy, weights synced into the in-process
vLLM) run without drafting, with `ngram` and with `siblings` (`release=restart`: one vLLM start per mode).

Measured: greedy tokens with and without (and the drafts accepted on the way); for sampled tokens, the log-probs
vLLM returns against the policy's own (the mismatch the trainer's guard watches, `rollout/logprob_diff_*`) and the
sampled distribution against the one without drafting (a chi-squared test of homogeneity per position over many
samples). On CPU the engine replaces vLLM's broken expand kernel (hybrid_rl/weightsync/vllm_cpu_kernels.py); then vLLM's
rejection sampler alone, with vLLM's own expand put back, on a known distribution (rejection_cpu.py): whether vLLM's
kernels are still wrong. The sibling drafter, greedy: two requests with one prompt, the second started after a short
request ends (two requests at a time), so its sibling is ahead of it; their tokens against the ones without drafting.
Writes the figures to $HR_TEST_OUT; the test says what they must be on this platform."""

import sys
from dataclasses import replace

import torch
from common import build, log, write_result
from rejection_cpu import TEMPERATURES, probe, sampler_probe

from hybrid_rl.model.logprobs import forward_logprobs
from hybrid_rl.rollout.speculative import Speculation
from hybrid_rl.types import Sampling

# Prompts that repeat themselves, so the n-gram drafter has something to propose.
REPEATING = [[5, 6, 7, 8, 9] * 3, [30, 31, 32, 30, 31, 32, 30, 31], [100, 200, 300, 400, 100, 200, 300]]
BASE = [58, 382, 266, 224, 20, 21]
SAMPLES, POSITIONS, LOGPROB_SAMPLES = 600, 6, 100


def chi2_homogeneity(a: list[int], b: list[int]) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) that two samples of tokens come from one distribution; tokens seen
    fewer than 10 times in both together are pooled into one category."""
    counts: dict[int, list[int]] = {}
    for k, xs in enumerate((a, b)):
        for x in xs:
            counts.setdefault(x, [0, 0])[k] += 1
    rare = [0, 0]
    table = []
    for c in counts.values():
        if sum(c) >= 10:
            table.append(c)
        else:
            rare = [rare[0] + c[0], rare[1] + c[1]]
    if sum(rare):
        table.append(rare)
    t = torch.tensor(table, dtype=torch.float64)
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = float(((t - expected) ** 2 / expected).sum())
    df = len(table) - 1
    return stat, df, float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                                    torch.tensor(stat / 2, dtype=torch.float64)))


def logprob_diffs(model, prompt: list[int], gens) -> list[float]:
    """|policy log-prob - vLLM's| of every sampled token (the guard's per-token mismatch)."""
    out = []
    with torch.no_grad():
        for g in gens:
            ids = torch.tensor([prompt + list(g.token_ids)])
            lp = forward_logprobs(model, ids, torch.arange(ids.shape[1])[None], torch.roll(ids, -1, dims=1))
            out += (lp[0, len(prompt) - 1: -1] - torch.tensor(g.logprobs)).abs().tolist()
    return out


def run_mode(engine, model, prompt: list[int]) -> dict:
    greedy = Sampling(max_tokens=24, temperature=0.0, n=1)
    sampled = Sampling(max_tokens=POSITIONS, temperature=1.0, n=SAMPLES)
    with engine.rollout_mode():
        greedy_gens = [g[0] for g in engine.generate(REPEATING, greedy, seeds=[1, 2, 3])]
        gens = engine.generate([prompt], sampled, seeds=[7])[0]
    diffs = logprob_diffs(model, prompt, gens[:LOGPROB_SAMPLES])
    finite = [d for d in diffs if d == d]
    return {"greedy": [list(g.token_ids) for g in greedy_gens],
            "greedy_drafted": sum(g.spec_drafted for g in greedy_gens),
            "greedy_accepted": sum(g.spec_accepted for g in greedy_gens),
            "positions": [[g.token_ids[k] for g in gens if len(g.token_ids) > k] for k in range(POSITIONS)],
            "drafted": sum(g.spec_drafted for g in gens), "accepted": sum(g.spec_accepted for g in gens),
            "lp_nan": len(diffs) - len(finite), "lp_diff_max": max(finite), "lp_diff_mean": sum(finite) / len(finite)}


def _registered_expand_is_ours() -> bool:
    from hybrid_rl.weightsync import vllm_cpu_kernels

    return getattr(vllm_cpu_kernels.installed(), "func", None) is vllm_cpu_kernels.expand


def run_siblings(engine) -> dict:
    """BASE twice and REPEATING[0] (3 tokens) between them, two requests at a time: the second sibling starts when the
    short request ends, behind the first, and drafts from it."""
    engine.vllm.spec = replace(engine.vllm.spec, max_num_seqs=2,
                               speculation=Speculation("siblings", tokens=3, ngram_min=1, ngram_max=3))
    prompts, limits = [BASE, REPEATING[0], BASE], [24, 3, 24]
    with engine.rollout_mode():
        gens = [g[0] for g in engine.generate(prompts, Sampling(max_tokens=24, temperature=0.0, n=1), seeds=[1, 2, 3],
                                              max_tokens=limits)]
    return {"tokens": [list(g.token_ids) for g in gens], "drafted": [g.spec_drafted for g in gens],
            "accepted": [g.spec_accepted for g in gens]}


def main(model_path: str) -> None:
    engine, model, _, _ = build(model_path, tp=1, release="restart")
    with torch.no_grad():  # random init is near uniform over the vocabulary: peak it on a few tokens per position
        model.lm_head.weight.mul_(6.0)
    with engine.rollout_mode():  # the model's own greedy text (a random model loops): the drafter finds its n-grams
        cont = list(engine.generate([BASE], Sampling(max_tokens=24, temperature=0.0, n=1), seeds=[0])[0][0].token_ids)
    prompt = BASE + cont
    off_seqs = engine.vllm.spec.max_num_seqs
    off = run_mode(engine, model, prompt)
    from hybrid_rl.weightsync import vllm_cpu_kernels

    vllms_expand = vllm_cpu_kernels.installed()  # vLLM's own (on CPU its C++ op, registered at the engine's start)
    # Before ngram: vLLM's n-gram drafter imports numba, after which vllm-cpu starts no other engine in the process.
    siblings = run_siblings(engine)
    engine.vllm.spec = replace(engine.vllm.spec, max_num_seqs=off_seqs,
                               speculation=Speculation("ngram", tokens=3, ngram_min=1, ngram_max=3))
    on = run_mode(engine, model, prompt)
    mended = _registered_expand_is_ours()
    chi2 = [chi2_homogeneity(a, b) for a, b in zip(off["positions"], on["positions"], strict=True)]
    log("chi2 per position (stat, df, p):", chi2, "drafted/accepted:", on["drafted"], on["accepted"])
    engine.close()
    probes = None
    if not torch.cuda.is_available():
        ours = [sampler_probe(t) for t in TEMPERATURES]  # the sampler alone with the engine's expand in place
        vllm_cpu_kernels.install(vllms_expand)  # vLLM's own again
        probes = {**probe(), "sampler_mended": ours}
    log("rejection sampler alone:", probes)
    write_result({"probe": probes, "mended": mended, "greedy_equal": off["greedy"] == on["greedy"], "greedy_off": off["greedy"],
                  "greedy_on": on["greedy"],
                  "chi2": chi2, "drafted": on["drafted"], "accepted": on["accepted"],
                  "drafted_off": off["drafted"] + off["greedy_drafted"], "prompt": prompt,
                  "greedy_drafted": on["greedy_drafted"], "greedy_accepted": on["greedy_accepted"],
                  "siblings": siblings, "base_greedy": cont,
                  "lp_nan": {"off": off["lp_nan"], "on": on["lp_nan"]},
                  "lp_diff": {"off": [off["lp_diff_max"], off["lp_diff_mean"]],
                              "on": [on["lp_diff_max"], on["lp_diff_mean"]]}})


if __name__ == "__main__":
    main(sys.argv[1])
