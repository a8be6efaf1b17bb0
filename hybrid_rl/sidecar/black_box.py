"""Black-box agents: a user's function plays one episode against the chat endpoint (`rollout.agent=pkg.mod:run`).

The agent is `run(base_url: str, row: dict) -> float | None`: it talks to the model only through an OpenAI client
(or plain HTTP) at `base_url`, and may return the episode's reward. Its calls, recorded as token ids by
`ChatEndpoint`, are stitched into trajectories (`stitch.stitch`: most episodes give one; a call that does not extend
the previous one starts another, and every one is trained). An agent that raises fails its episode (counted, not
scored).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybrid_rl.rollout.tools.spec import load_object
from hybrid_rl.rollout.trajectory import Trajectory
from hybrid_rl.sidecar.chat_endpoint import ChatEndpoint
from hybrid_rl.sidecar.completions import Router
from hybrid_rl.sidecar.stitch import RecordedCall, stitch
from hybrid_rl.types import Sampling

Agent = Callable[[str, dict], "float | None"]


@dataclass(frozen=True)
class Episode:
    trajectories: list[Trajectory]
    calls: list[RecordedCall]
    reward: float | None  # what the agent returned (None: the run's reward functions judge)
    error: str = ""  # the agent raised: the episode is an infrastructure failure


def load_agent(path: str) -> Agent:
    agent = load_object(path, "rollout.agent")
    if not callable(agent):
        raise ValueError(f"rollout.agent {path!r} is not callable: expected run(base_url, row) -> reward or None")
    return agent


def play(endpoint: ChatEndpoint, agent: Agent, row: dict, *, episode: str, seed: int, sampling: Sampling,
         router: Router) -> Episode:
    """Run `agent` on `row` against a fresh episode of `endpoint`; its calls as trajectories."""
    base_url = endpoint.open(episode, sampling=sampling, router=router, seed=seed)
    error, reward = "", None
    try:
        got = agent(base_url, row)
        reward = None if got is None else float(got)
    except Exception as e:  # noqa: BLE001 - the user's code: its failure is the episode's, reported
        error = f"{type(e).__name__}: {e}"
    finally:
        calls = endpoint.close(episode)
    return Episode(stitch(calls), calls, reward, error)
