"""Black-box agents in training (`rollout.mode=sidecar` + `rollout.agent=pkg.mod:run`): one agent episode per
sample, against the chat endpoint, through the multi-turn sidecar's streaming machinery.

Each submitted request becomes a thread (`MultiTurnSidecar`'s) that plays the user's agent on the request's row
(`black_box.play`): every model call the agent makes goes through `ChatEndpoint` to the server the request's key
sticks to, and is recorded as the ids that server saw, each sampled id with the policy version that sampled it. The
episode's stitched trajectories are its samples, all trained (`Arrival.earlier`, then the last one; prompt = each
trajectory's first call's ids; the loss mask covers exactly the sampled ids). The last trajectory is what the reward
functions judge, and the episode's reward is given to each of its trajectories: the advantage is computed once per
episode (`BatchIndex.episodes`), so an episode that split into more pieces does not weigh more in its group. The
agent's return value is the `env_reward` field (the `agent` reward, weight 1); an agent that raises or makes no call
is an infrastructure failure (left out of the group statistics and the loss).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import replace

import torch

from hybrid_rl.rollout.base import Arrival
from hybrid_rl.rollout.chat_template import TemplateFamily
from hybrid_rl.rollout.trajectory import Trajectory
from hybrid_rl.sidecar.black_box import Agent, play
from hybrid_rl.sidecar.chat_endpoint import ChatEndpoint
from hybrid_rl.sidecar.completions import Router
from hybrid_rl.sidecar.multi_turn import MultiTurnSidecar
from hybrid_rl.sidecar.rollout import SidecarRollout
from hybrid_rl.sidecar.versions import token_versions_of
from hybrid_rl.types import Generation, Request, Sampling

log = logging.getLogger(__name__)


class AgentSidecar(MultiTurnSidecar):
    """The sidecar rollout worker that plays a black-box agent per sample (its threads, sessions and batches are
    `MultiTurnSidecar`'s; only the trajectory differs)."""

    def __init__(self, inner: SidecarRollout, tokenizer, family: TemplateFamily, agent: Agent, *, max_inflight: int):
        self.inner, self.tokenizer, self.agent = inner, tokenizer, agent
        self.endpoint = ChatEndpoint(inner.stream, tokenizer, family, model=inner.model_name, versions=self._versions)
        self._init_threads(max_inflight)

    def close(self) -> None:
        self._closed = True
        self.endpoint.shutdown()
        self.inner.close()
        self._drain()

    def _trajectory(self, r: Request, sampling: Sampling, router: Router) -> Arrival:
        row = dict(r.row or {})
        ep = play(self.endpoint, self.agent, row, episode=episode_id(r.key), seed=r.seed,
                  sampling=sampling, router=_Pinned(router, r))
        if ep.error or not ep.trajectories:
            why = ep.error or "the agent made no model call"
            log.warning("agent episode %s is an infrastructure failure (dropped from the step): %s", r.key, why)
            return Arrival(Generation(0, (), (), "stop"), torch.zeros(0, dtype=torch.int64), infra_failed=True,
                           fields={"agent_error": why}, stats={"n": 1.0, "infra": 1.0})
        fields = {"env_reward": ep.reward} if ep.reward is not None else {}
        *earlier, last = (self._arrival(t) for t in ep.trajectories)
        model = sum(t.model_tokens for t in ep.trajectories)
        stats = {"n": 1.0, "turns": float(sum(t.turns for t in ep.trajectories)),
                 "trajectories": float(len(ep.trajectories)), "model_tokens": float(model),
                 "context_tokens": float(sum(len(t.response_ids) for t in ep.trajectories) - model)}
        return replace(last, fields=fields, stats=stats, earlier=tuple(earlier))

    @staticmethod
    def _arrival(t: Trajectory) -> Arrival:
        """One stitched trajectory as a sample's arrival: its own prompt, ids, log-probs, mask and token versions (none
        when a call carried none, or a token came from weights of no known policy version)."""
        versions = torch.tensor(t.versions, dtype=torch.int64)
        if (versions < 0).any():
            versions = torch.zeros(0, dtype=torch.int64)
        return Arrival(Generation(0, tuple(t.response_ids), tuple(t.logprobs), "stop"), versions,
                       torch.tensor(t.loss_mask, dtype=torch.bool), prompt_ids=tuple(t.prompt_ids))

    def _versions(self, g: Generation) -> list[int]:
        """The policy version of each of a call's sampled ids (the server's spans); a version this run never pushed
        fails the call, as it fails any other request."""
        if unknown := [v for v, _, _ in g.weight_spans if v not in self.inner.policy_of]:
            raise RuntimeError(f"tokens sampled under weight version {unknown[0]!r}, which this run did not push")
        return token_versions_of(g, self.inner.policy_of).tolist()


class _Pinned:
    """The run's router with every call of one episode keyed as its request (one server: its prefix cache)."""

    def __init__(self, router: Router, r: Request):
        self.router, self.affinity = router, r.key if r.affinity is None else r.affinity

    def pick(self, call: Request, cost: int) -> str:
        return self.router.pick(Request(call.key, call.prompt, call.seed, affinity=self.affinity), cost)

    def done(self, url: str, cost: int) -> None:
        self.router.done(url, cost)


def episode_id(key: int) -> str:
    """An episode's id, the only credential of its chat-endpoint URL: 128 random bits (unguessable by another
    process on the node that could reach the endpoint)."""
    return f"{key}-{secrets.token_hex(16)}"
