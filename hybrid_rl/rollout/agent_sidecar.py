"""Black-box agents in training (`rollout.mode=sidecar` + `rollout.agent=pkg.mod:run`): one agent episode per
sample, against the chat endpoint, through the multi-turn sidecar's streaming machinery.

Each submitted request becomes a thread (`MultiTurnSidecar`'s) that plays the user's agent on the request's row
(`black_box.play`): every model call the agent makes goes through `ChatEndpoint` to the server the request's key
sticks to, and is recorded as the ids that server saw. The episode's first stitched trajectory is the sample
(prompt = its first call's ids; the loss mask covers exactly the sampled ids); further trajectories (calls that did
not extend it) are counted in `rollout/agent_extra_samples`, not yet trained: the buffer holds one sample per
request. The agent's return value is the sample's `env_reward` field (the `agent` reward, weight 1); an agent that
raises or makes no call is an infrastructure failure (left out of the group statistics and the loss).
"""

from __future__ import annotations

import queue
import threading
import uuid

import torch

from hybrid_rl.engine.vllm_engine import Generation, Sampling
from hybrid_rl.rollout.agentic_sidecar import MultiTurnSidecar
from hybrid_rl.rollout.base import Arrival
from hybrid_rl.rollout.black_box import Agent, play
from hybrid_rl.rollout.chat_endpoint import ChatEndpoint
from hybrid_rl.rollout.chat_template import TemplateFamily
from hybrid_rl.rollout.sidecar import SidecarRollout
from hybrid_rl.sidecar.completions import Request, Router


class AgentSidecar(MultiTurnSidecar):
    """The sidecar rollout worker that plays a black-box agent per sample (its threads, sessions and batches are
    `MultiTurnSidecar`'s; only the trajectory differs)."""

    def __init__(self, inner: SidecarRollout, tokenizer, family: TemplateFamily, agent: Agent, *, max_inflight: int):
        self.inner, self.tokenizer, self.agent = inner, tokenizer, agent
        self.endpoint = ChatEndpoint(inner.stream, tokenizer, family, model=inner.model_name)
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._closed = False
        self._arrived: queue.SimpleQueue[tuple[int, Arrival | None, str]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0

    def close(self) -> None:
        self._closed = True
        self.endpoint.shutdown()
        self.inner.close()

    def _trajectory(self, r: Request, sampling: Sampling, router: Router) -> Arrival:
        row = dict(r.row or {})
        ep = play(self.endpoint, self.agent, row, episode=f"{r.key}-{uuid.uuid4().hex[:8]}", seed=r.seed,
                  sampling=sampling, router=_Pinned(router, r))
        empty = Generation(0, (), (), "stop")
        if ep.error or not ep.trajectories:
            why = ep.error or "the agent made no model call"
            return Arrival(empty, torch.zeros(0, dtype=torch.int64), infra_failed=True,
                           fields={"agent_error": why}, stats={"n": 1.0, "infra": 1.0})
        t = ep.trajectories[0]
        gen = Generation(0, tuple(t.response_ids), tuple(t.logprobs), "stop")
        fields = {"env_reward": ep.reward} if ep.reward is not None else {}
        stats = {"n": 1.0, "turns": float(t.turns), "extra_samples": float(len(ep.trajectories) - 1),
                 "model_tokens": float(t.model_tokens), "context_tokens": float(len(t.response_ids) - t.model_tokens)}
        return Arrival(gen, torch.zeros(0, dtype=torch.int64), torch.tensor(t.loss_mask, dtype=torch.bool), fields,
                       stats=stats, prompt_ids=tuple(t.prompt_ids))


class _Pinned:
    """The run's router with every call of one episode keyed as its request (one server: its prefix cache)."""

    def __init__(self, router: Router, r: Request):
        self.router, self.affinity = router, r.key if r.affinity is None else r.affinity

    def pick(self, call: Request, cost: int) -> str:
        return self.router.pick(Request(call.key, call.prompt, call.seed, affinity=self.affinity), cost)

    def done(self, url: str, cost: int) -> None:
        self.router.done(url, cost)
