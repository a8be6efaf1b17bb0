"""A rollout stand-in for GPU machines without vLLM: the trained module itself samples, eagerly.

The GPU checks run where PyTorch is installed but vLLM is not (its CUDA wheel does not travel there). Everything
on the training side is the product's own code (`build`, `Trainer`, FSDP2, the passes, the update, offload,
checkpoints, the memory plan); only the generator behind the real `Sampler` is this class, registered as the
`colocated` rollout mode by `train_worker.py`. It samples from the actor's own weights, so there is no weight sync
to test here (the resharder's CUDA path is tested on CPU with vLLM's classes), but the samples and their log-probs
are that model's, and the trainer's mismatch guard compares them with its own bf16 passes as it would vLLM's.

Sampling is a plain KV-cached decode loop over the whole batch (left-padded prompts), full vocabulary at the
sampling temperature (no top-k/top-p: the trainer refuses them), one log-softmax row per token and step.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from hybrid_rl.colocated.hybrid import SwitchReport
from hybrid_rl.types import Generation, Sampling


class EagerEngine:
    """The `HybridEngine` methods `Sampler` calls, backed by the training module (a world of one rank)."""

    def __init__(self, module: torch.nn.Module, pad_id: int, device: torch.device):
        self.module, self.pad_id, self.device = module, pad_id, device
        self.report = SwitchReport()

    @contextmanager
    def rollout_mode(self):
        """Eval mode while sampling, then every module's own flag back.

        With activation checkpointing the decoder blocks carry `training=True` under an eval-mode model
        (`model.loading.enable_activation_checkpointing`): transformers then drops the KV cache (each decoded
        token would see no past), so they are cleared here. A plain `module.train(was_training)` after would
        leave them cleared, and every later update would keep all of its activations (seen on the GPU: 48.7 GiB
        against the plan's 33.3 at 1.5B): each flag is restored as it was.
        """
        flags = [(m, m.training) for m in self.module.modules()]
        self.module.eval()
        try:
            yield self
        finally:
            for m, training in flags:
                m.training = training

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling, seeds: list[int],
                 max_tokens: list[int] | None = None) -> list[list[Generation]]:
        if max_tokens is not None:
            raise NotImplementedError("per-request max_tokens (multi-turn) is not needed by the GPU checks")
        rows = [p for p in prompts for _ in range(sampling.n)]
        tokens, logps, stopped = self._decode(rows, sampling, seed=seeds[0] if seeds else 0)
        out: list[list[Generation]] = []
        for i in range(len(prompts)):
            gens = []
            for j in range(sampling.n):
                r = i * sampling.n + j
                length = int(stopped[r]) + 1 if stopped[r] >= 0 else tokens.shape[1]
                gens.append(Generation(i, tokens[r, :length].tolist(), logps[r, :length].tolist(),
                                       "stop" if stopped[r] >= 0 else "length"))
            out.append(gens)
        return out

    def _decode(self, rows: list[list[int]], s: Sampling, *, seed: int):
        """-> (tokens [B, T], log-probs [B, T], index of each row's stop token or -1), on the host."""
        dev, width = self.device, max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(rows):  # left padding: every row's next token is at the same column
            ids[b, width - len(r):] = torch.tensor(r)
            mask[b, width - len(r):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        stop = torch.tensor(s.stop_token_ids or [-1], device=dev)
        g = torch.Generator(device=dev).manual_seed(seed)
        out = self.module(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        cache, last = out.past_key_values, pos[:, -1:]
        tokens, logps = [], []
        stopped = torch.full((len(rows),), -1, dtype=torch.long, device=dev)
        for t in range(s.max_tokens):
            logits = out.logits[:, -1].float()
            logp = torch.log_softmax(logits / s.temperature, -1) if s.temperature > 0 else torch.log_softmax(logits, -1)
            nxt = (torch.multinomial(logp.exp(), 1, generator=g)[:, 0] if s.temperature > 0 else logp.argmax(-1))
            done = stopped >= 0
            tokens.append(torch.where(done, self.pad_id, nxt))
            logps.append(torch.where(done, 0.0, logp.gather(1, nxt[:, None])[:, 0]))
            stopped = torch.where(~done & torch.isin(nxt, stop), t, stopped)
            if t + 1 == s.max_tokens or bool((stopped >= 0).all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            last = last + 1
            out = self.module(input_ids=nxt[:, None], attention_mask=mask, position_ids=last, past_key_values=cache,
                              use_cache=True)
        return torch.stack(tokens, 1).cpu(), torch.stack(logps, 1).cpu(), stopped.cpu()
