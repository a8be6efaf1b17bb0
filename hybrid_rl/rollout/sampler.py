"""Prompts in, samples out: each DP group generates for its share of the prompts, then all ranks share all samples.

The ranks of one vLLM TP group must submit identical requests, so the share and the per-request
seeds depend only on the DP rank, the step and the prompt's position, never on the global rank.
After generation, every rank receives every sample (token ids are cheap to move), so rewards,
group statistics and the token-balanced split for training can be computed without further
coordination.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from hybrid_rl.data import PromptRecord
from hybrid_rl.dist.mesh import ParallelDims
from hybrid_rl.engine.hybrid import HybridEngine
from hybrid_rl.engine.vllm_engine import Sampling
from hybrid_rl.types import Sample


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int


class Sampler:
    """Turns a batch of prompt records into samples, `n` per prompt, generated data-parallel."""

    def __init__(self, engine: HybridEngine, tokenizer, dims: ParallelDims, settings: SamplingSettings, *, seed: int):
        self.engine, self.tokenizer, self.dims, self.settings, self.seed = engine, tokenizer, dims, settings, seed
        self.stop_ids = tuple(sorted({tokenizer.eos_token_id} | set(_generation_eos(tokenizer))))

    def generate(self, records: list[PromptRecord], *, n: int, step: int, group_base: int,
                 greedy: bool = False) -> list[Sample]:
        """Sample `n` responses for every record (the same list on every rank); returns all samples, on all ranks.

        Must be called in rollout mode, on every rank. Samples of record i get group `group_base + i`.
        """
        d = self.dims
        mine = list(range(d.dp_rank, len(records), d.dp))
        s = self.settings
        sampling = Sampling(max_tokens=s.max_new_tokens, temperature=0.0 if greedy else s.temperature,
                            top_p=1.0 if greedy else s.top_p, top_k=-1 if greedy else s.top_k, n=n,
                            stop_token_ids=self.stop_ids)
        seeds = [hash((self.seed, step, group_base + i)) % (2**31) for i in mine]
        outs = self.engine.generate([list(records[i].prompt_ids) for i in mine], sampling, seeds)
        local = []
        for i, gens in zip(mine, outs, strict=True):
            rec = records[i]
            for g in gens:
                local.append(Sample(rec.prompt_ids, g.token_ids, g.logprobs, g.finish_reason == "length",
                                    group_base + i, rec.index, rec.fields,
                                    self.tokenizer.decode(g.token_ids, skip_special_tokens=True)))
        return _share_across_dp_groups(local if d.tp_rank == 0 else [], d)


def _share_across_dp_groups(local: list[Sample], dims: ParallelDims) -> list[Sample]:
    """Every rank gets every DP group's samples, ordered by group id."""
    if dims.world == 1:
        return local
    gathered: list[list[Sample]] = [[] for _ in range(dims.world)]
    dist.all_gather_object(gathered, local)
    return sorted((s for part in gathered for s in part), key=lambda s: s.group)


def _generation_eos(tokenizer) -> list[int]:
    """Extra end-of-turn ids some chat tokenizers define besides eos (e.g. <|im_end|> vs <|endoftext|>)."""
    ids = []
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id:
            ids.append(i)
    return ids
