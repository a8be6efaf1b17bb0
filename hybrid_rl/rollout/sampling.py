"""What both deployments share about sampling: settings, per-request seeds, a `Sample` from a `Generation`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_rl.data import PromptRecord
from hybrid_rl.types import Generation, Sample


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    speculative: bool = False  # `rollout.speculative` on: drafted and accepted tokens go into the step's metrics


def request_seed(seed: int, step: int, group: int) -> int:
    """The seed of a prompt's first sample (sample j: + j): the same whichever rank or server generates it."""
    return hash((seed, step, group)) % (2**31)


def sample_of(uid: int, record: PromptRecord, g: Generation, group: int, prompt: torch.Tensor | None = None, *,
              token_versions: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
              extra_fields: Mapping[str, Any] | None = None, part: int = 0) -> Sample:
    prompt = torch.tensor(record.prompt_ids, dtype=torch.int64) if prompt is None else prompt
    versions = torch.zeros(0, dtype=torch.int64) if token_versions is None else token_versions
    mask = torch.zeros(0, dtype=torch.bool) if loss_mask is None else loss_mask
    fields = {**record.fields, **extra_fields} if extra_fields else record.fields
    routes = {} if g.routes is None else {"routes": g.routes}
    return Sample(uid, prompt, torch.as_tensor(g.token_ids, dtype=torch.int64),
                  torch.as_tensor(g.logprobs, dtype=torch.float32), g.finish_reason == "length", group, record.index,
                  fields, versions, mask, part, **routes)


def generation_eos(tokenizer) -> list[int]:
    """Extra end-of-turn ids some chat tokenizers define besides eos (e.g. <|im_end|> vs <|endoftext|>)."""
    ids = []
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id:
            ids.append(i)
    return ids
