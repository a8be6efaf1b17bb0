"""The in-process vLLM driven request by request (`rollout.turn_schedule.TurnEngine`): the multi-turn loop's
per-trajectory schedule adds a trajectory's next turn the moment its tools answer, while the others generate.

vLLM 0.32's offline `LLM` exposes the pieces: `LLM.enqueue` renders and queues requests without running them, and
its `llm_engine.step()` advances one scheduler step and returns what finished (`LLM.generate` is these two in a
loop). Each request carries its own seed (`SamplingParams.seed`): what a turn samples depends on its trajectory and
turn only, never on which other requests shared its steps (they depend on when tools returned). On CPU, vLLM rewinds
a seeded request's generator when a prompt is split across steps, which CPU generators cannot do: the engine is
built without chunked prefill there (`vllm_engine._llm_kwargs`).
"""

from __future__ import annotations

import torch

from hybrid_rl.colocated import routes
from hybrid_rl.colocated.vllm_engine import VLLMEngine, _generation, request_params
from hybrid_rl.types import Generation, Sampling


class EngineTurns:
    """One rollout's requests on the in-process engine, keyed by trajectory."""

    def __init__(self, engine: VLLMEngine, sampling: Sampling, tally=None):
        self.engine, self.sampling, self.tally = engine, sampling, tally
        self.llm = engine.llm
        self._keys: dict[str, tuple[int, int]] = {}  # vLLM's request id -> (trajectory, its context length)
        if self.llm.llm_engine.has_unfinished_requests():
            raise RuntimeError("the rollout engine still runs requests from before: a rollout must start idle")

    def add(self, key: int, context: list[int], max_tokens: int, seed: int) -> None:
        params = request_params(self.sampling, max_tokens, seed)
        (rid,) = self.llm.enqueue([{"prompt_token_ids": list(context)}], [params], lora_request=self.engine._adapter,
                                  use_tqdm=False)
        self._keys[_external(rid)] = (key, len(context))

    def busy(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def step(self) -> list[tuple[int, Generation]]:
        # every request draws from its own generator; the process's RNG (the trainer's) is left as it was regardless
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            finished = [o for o in self.llm.llm_engine.step() if o.finished]
        if not finished:
            return []
        got = routes.taken(self.llm) if self.engine.spec.capture_routes else {}
        out = []
        for o in finished:
            rid = _external(o.request_id)
            key, prompt_len = self._keys.pop(rid)
            out.append((key, _generation(key, o.outputs[0], got.get(rid), prompt_len)))
        if self.tally is not None:
            self.tally.add(g for _, g in out)
        return out


def _external(request_id: str) -> str:
    """The id `enqueue` gave, without the random suffix vLLM may add to make it unique inside the engine."""
    return request_id.rsplit("-", 1)[0]
