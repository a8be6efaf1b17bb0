"""Multi-turn rollouts with tools, colocated: the `Sampler`'s engine driven turn by turn by the tool loop.

`rollout.tools` or `rollout.environment` set: `build.py` wraps the colocated `Sampler` in `MultiTurnRollout`, which
is a `RolloutWorker` like any other, so the trainer has no multi-turn branch. Each DP group plays its share of the
prompts' `n` trajectories in lockstep (`multi_turn.ToolLoop`): every turn sends only the active trajectories to the
in-process vLLM, as token ids, each with what is left of its response budget. At `rollout.tp > 1` the ranks of a
vLLM group play the same trajectories (vLLM's external launcher needs identical requests from them): each
trajectory's tools and environment live on one rank of the group (its sample's holder), and the group exchanges
the answers every turn (`GroupShare`), so every rank appends the same ids.

Infrastructure failures (a tool worker that died, a call stuck past its limit, a tool raising `ToolInfraError`, an
environment that could not start) are not the model's fault: those samples are dropped from the step before anything
sees them (group statistics, the loss, the reward mean), the rest renumbered, and their share logged as
`rollout/infra_failed_rate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_rl.distributed.collectives import all_gather_rows, all_reduce
from hybrid_rl.rollout.base import RolloutError
from hybrid_rl.rollout.chat_template import ToolSuffix
from hybrid_rl.rollout.environment import Opening
from hybrid_rl.rollout.exchange import gather_index
from hybrid_rl.rollout.multi_turn import ToolLoop
from hybrid_rl.rollout.tools import Environment, ToolRunner
from hybrid_rl.rollout.trajectory import Trajectory
from hybrid_rl.types import Rollout, Sample


@dataclass(frozen=True)
class AgentSetup:
    """What a multi-turn rollout needs besides the engine (built once per run by `build.py`)."""

    loop: ToolLoop
    runner: ToolRunner
    suffix: ToolSuffix
    environment: Environment | None
    max_prompt_tokens: int = 0  # an environment's own prompt longer than this fails its trajectory (0: no limit)
    schedule: str = "trajectory"  # colocated: each trajectory at its own pace (`turn_schedule`), or "lockstep"


def opened(o: Opening) -> Trajectory:
    """A trajectory from its opening; one whose environment could not start is over before it began (dropped)."""
    t = Trajectory(list(o.prompt_ids))
    if o.error:
        t.infra_failed, t.done = True, True
    return t


def stats_of(t: Trajectory) -> dict[str, float]:
    """One trajectory's counts, as the metrics sum them."""
    model = t.model_tokens
    return {"n": 1.0, "turns": t.turns, "tool_calls": t.tool_calls, "calling": float(t.tool_calls > 0),
            "malformed": t.malformed_calls, "errors": t.tool_errors, "timeouts": t.tool_timeouts,
            "infra": float(t.infra_failed), "truncated": float(t.truncated), "model_tokens": model,
            "context_tokens": len(t.response_ids) - model, "user_turns": t.user_turns,
            "turn_reward": sum(t.turn_rewards)}


_KEYS = ("n", "turns", "tool_calls", "calling", "malformed", "errors", "timeouts", "infra", "truncated", "model_tokens",
         "context_tokens", "tool_s", "generate_s", "trajectories", "user_turns", "turn_reward")


def trajectory_metrics(stats: list[dict[str, float]], wall: tuple[float, float] | None = None) -> dict[str, float]:
    """The multi-turn metrics of these trajectories (summed over ranks: each rank passes its own). Collective.

    `wall`: (seconds waiting on tools, seconds of the whole loop) of a lockstep loop (the slowest rank's); without
    it, the share of tool time is that of the trajectories' own summed tool and generation seconds."""
    sums = dict(zip(_KEYS, all_reduce(torch.tensor([sum(s.get(k, 0.0) for s in stats) for k in _KEYS],
                                                   dtype=torch.float64)).tolist(), strict=True))
    if wall is not None:
        tool_s, loop_s = all_reduce(torch.tensor(wall, dtype=torch.float64), "max").tolist()
    else:
        tool_s, loop_s = sums["tool_s"], sums["tool_s"] + sums["generate_s"]
    n = sums["n"]
    if n == 0:
        return {}
    return {"rollout/turns_mean": sums["turns"] / n, "rollout/tool_calls_mean": sums["tool_calls"] / n,
            "rollout/tool_call_rate": sums["calling"] / n, "rollout/malformed_calls": sums["malformed"],
            "rollout/tool_errors": sums["errors"], "rollout/tool_timeouts": sums["timeouts"],
            "rollout/infra_failed_rate": sums["infra"] / n, "rollout/budget_truncated_rate": sums["truncated"] / n,
            "rollout/model_tokens_mean": sums["model_tokens"] / n,
            "rollout/context_tokens_mean": sums["context_tokens"] / n, "timing/tool_s": tool_s,
            "rollout/tool_time_share": tool_s / loop_s if loop_s > 0 else 0.0,
            # environments: user-simulator turns and per-turn rewards (summed over each trajectory)
            **({"rollout/user_turns_mean": sums["user_turns"] / n} if sums["user_turns"] else {}),
            **({"rollout/turn_reward_mean": sums["turn_reward"] / n} if sums["turn_reward"] else {}),
            # black-box agents: the trajectories each episode was stitched into (each one a trained sample)
            **({"rollout/trajectories_per_episode": sums["trajectories"] / n} if sums["trajectories"] else {})}


def keep_survivors(samples: dict[int, Sample], failed: set[int], size: int, stats: list[dict[str, float]], *,
                   wall: tuple[float, float] | None = None) -> Rollout:
    """The step's rollout from this rank's samples by uid (0..size-1 over all ranks), less those whose tools failed
    for infrastructure reasons (every rank's), the survivors renumbered 0.. in uid order; with the metrics.
    Collective."""
    keep = torch.ones(size, dtype=torch.bool)
    keep[all_gather_rows(torch.tensor(sorted(failed), dtype=torch.int64))] = False
    if not keep.any():
        raise RolloutError(f"every one of the step's {size} trajectories hit a tool infrastructure failure (see the "
                           "tool errors above); check the tools' services")
    new_uid = torch.cumsum(keep.long(), 0) - 1
    held = [s.renumbered(int(new_uid[u])) for u, s in sorted(samples.items()) if keep[u]]
    return Rollout(held, gather_index(held, int(keep.sum())), trajectory_metrics(stats, wall))
