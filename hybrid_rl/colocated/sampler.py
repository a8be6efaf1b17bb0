"""Prompts in, samples out: each DP group generates for its share of the prompts; each sample is held by one rank.

The ranks of one vLLM TP group must submit identical requests, so the share and the per-request
seeds depend only on the DP rank, the step and the prompt's position, never on the global rank.
Every TP rank of a group receives the group's outputs; the group's samples are then split between
its TP ranks (`uid % tp`), so that each sample is held (scored, then sent to its trainer) by exactly
one rank. What all ranks learn about all samples is the small `BatchIndex` (one all-gather).
"""

from __future__ import annotations

import torch

from hybrid_rl.colocated.hybrid import HybridEngine
from hybrid_rl.data import PromptRecord
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.rollout.base import SyncReport
from hybrid_rl.rollout.exchange import gather_index
from hybrid_rl.rollout.sampling import SamplingSettings, generation_eos, request_seed, sample_of
from hybrid_rl.rollout.speculative import SpecTally
from hybrid_rl.types import Rollout, Sampling


class Sampler:
    """The colocated rollout worker (`rollout.mode=colocated`): prompt records in, samples out, `n` per prompt,
    generated data-parallel by the hybrid engine on the training ranks."""

    def __init__(self, engine: HybridEngine, tokenizer, dims: ParallelDims, settings: SamplingSettings, *, seed: int):
        self.engine, self.dims, self.settings, self.seed = engine, dims, settings, seed
        self.stop_ids = tuple(sorted({tokenizer.eos_token_id} | set(generation_eos(tokenizer))))

    def session(self, version: int | None = None):
        """Rollout mode: train state offloaded, weights synced into vLLM; back to train mode after (every session
        syncs: colocated vLLM never keeps weights across a switch it did not make itself)."""
        return self.engine.rollout_mode()

    def keep_room_for(self, optimizer, offload: str) -> None:
        self.engine.keep_room_for(optimizer, offload)

    def last_sync(self) -> SyncReport:
        seconds = self.engine.report.seconds
        sync = ("sync_weights", "sync_adapter")  # the adapter's own step with `model.lora.sync=adapter`
        return SyncReport(sum(seconds.get(k, 0.0) for k in sync), sum(v for k, v in seconds.items() if k not in sync),
                          self.engine.report.bytes_received)

    def close(self) -> None:
        self.engine.close()

    def sampling(self, greedy: bool, n: int) -> Sampling:
        """The run's sampling settings for `n` responses per prompt; `greedy` (validation): argmax, no truncation."""
        s = self.settings
        return Sampling(max_tokens=s.max_new_tokens, temperature=0.0 if greedy else s.temperature,
                        top_p=1.0 if greedy else s.top_p, top_k=-1 if greedy else s.top_k, n=n,
                        stop_token_ids=self.stop_ids)

    def generate(self, records: list[PromptRecord], *, n: int, step: int, group_base: int,
                 greedy: bool = False) -> Rollout:
        """Sample `n` responses for every record (the same list on every rank). Collective, in rollout mode.

        Sample `j` of record `i` has uid `i * n + j` and group `group_base + i`.
        """
        d = self.dims
        mine = list(range(d.dp_rank, len(records), d.dp))
        s = self.settings
        sampling = self.sampling(greedy, n)
        seeds = [request_seed(self.seed, step, group_base + i) for i in mine]
        outs = self.engine.generate([list(records[i].prompt_ids) for i in mine], sampling, seeds)
        held, metrics = [], {}
        if s.speculative:  # every rank of a TP group gets the group's outputs
            tally = SpecTally()
            tally.add(g for gens in outs for g in gens)
            metrics = tally.metrics(copies=d.tp)
        for i, gens in zip(mine, outs, strict=True):
            prompt = torch.tensor(records[i].prompt_ids, dtype=torch.int64)
            for j, g in enumerate(gens):
                if (i * n + j) % d.tp == d.tp_rank:
                    held.append(sample_of(i * n + j, records[i], g, group_base + i, prompt))
        return Rollout(held, gather_index(held, len(records) * n), metrics)

