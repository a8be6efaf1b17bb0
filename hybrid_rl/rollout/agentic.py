"""Multi-turn rollouts with tools, colocated: the `Sampler`'s engine driven turn by turn by the tool loop.

`rollout.tools` or `rollout.environment` set: `build.py` wraps the colocated `Sampler` in `MultiTurnRollout`, which
is a `RolloutWorker` like any other, so the trainer has no multi-turn branch. Each DP group plays its share of the
prompts' `n` trajectories in lockstep (`multi_turn.ToolLoop`): every turn sends only the active trajectories to the
in-process vLLM, as token ids, each with what is left of its response budget.

Infrastructure failures (a tool worker that died, a call stuck past its limit, a tool raising `ToolInfraError`) are
not the model's fault: those samples are dropped from the step before anything sees them (group statistics, the
loss, the reward mean), the rest renumbered, and their share logged as `rollout/infra_failed_rate`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybrid_rl.data import PromptRecord
from hybrid_rl.dist.collectives import all_gather_rows, all_reduce
from hybrid_rl.engine.vllm_engine import Generation, Sampling
from hybrid_rl.rollout.base import RolloutError, SyncReport
from hybrid_rl.rollout.chat_template import ToolSuffix
from hybrid_rl.rollout.exchange import gather_index
from hybrid_rl.rollout.multi_turn import ToolLoop
from hybrid_rl.rollout.sampler import Sampler, request_seed
from hybrid_rl.rollout.tools import Environment, ToolRunner
from hybrid_rl.rollout.trajectory import Trajectory
from hybrid_rl.types import Rollout, Sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentSetup:
    """What a multi-turn rollout needs besides the engine (built once per run by `build.py`)."""

    loop: ToolLoop
    runner: ToolRunner
    suffix: ToolSuffix
    environment: Environment | None


class MultiTurnRollout:
    """The colocated rollout worker with tools (`rollout.mode=colocated` + `rollout.tools` / `rollout.environment`)."""

    def __init__(self, sampler: Sampler, tokenizer, setup: AgentSetup):
        self.sampler, self.tokenizer, self.setup = sampler, tokenizer, setup

    def session(self, version: int | None = None):
        return self.sampler.session(version)

    def last_sync(self) -> SyncReport:
        return self.sampler.last_sync()

    def close(self) -> None:
        self.setup.runner.close()
        self.sampler.close()

    def generate(self, records: list[PromptRecord], *, n: int, step: int, group_base: int,
                 greedy: bool = False) -> Rollout:
        """`n` trajectories per record, uid `i * n + j` and group `group_base + i` as `Sampler.generate`, less the
        infrastructure failures (the survivors renumbered 0..). Collective, in a session."""
        s = self.sampler
        d = s.dims
        mine = [(i, j) for i in range(d.dp_rank, len(records), d.dp) for j in range(n)]
        trajs, envs = [], []
        for i, _ in mine:
            env, prompt = self._start(records[i])
            trajs.append(Trajectory(prompt))
            envs.append(env)
        seeds = [request_seed(s.seed, step, group_base + i) + j for i, j in mine]
        start = time.monotonic()
        stats = self.setup.loop.run(trajs, envs, self._generate_fn(greedy), seeds)
        loop_s = time.monotonic() - start
        fields = [self._fields(records[i], t, env) for (i, _), t, env in zip(mine, trajs, envs, strict=True)]
        samples = {i * n + j: t.to_sample(i * n + j, group_base + i, records[i].index, f)
                   for (i, j), t, f in zip(mine, trajs, fields, strict=True)}
        failed = {i * n + j for (i, j), t in zip(mine, trajs, strict=True) if t.infra_failed}
        return keep_survivors(samples, failed, len(records) * n, [stats_of(t) for t in trajs],
                              wall=(stats.tool_seconds, loop_s))

    def _start(self, record: PromptRecord) -> tuple[object | None, list[int]]:
        """A new environment for the trajectory (reset with the row), and the prompt ids: the row's, or those of the
        prompt `reset` returned, rendered with the tools."""
        env_spec = self.setup.environment
        if env_spec is None:
            return None, list(record.prompt_ids)
        env = env_spec.new()
        prompt = env.reset(**dict(record.fields))
        if prompt is None:
            return env, list(record.prompt_ids)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = self.tokenizer.apply_chat_template(messages, tools=self.setup.suffix.tools, tokenize=False,
                                                  add_generation_prompt=True)
        return env, list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _fields(self, record: PromptRecord, t: Trajectory, env) -> dict:
        """The row's reward fields plus what the reward may judge: the calls made, the environment's reward."""
        out = dict(record.fields)
        out["tool_calls"] = list(t.log)
        if env is not None and self.setup.environment.has_reward and not t.infra_failed:
            try:
                out["env_reward"] = float(env.reward())
            except Exception as e:  # noqa: BLE001 - the environment is user code: its failure scores 0, loudly
                log.warning("the environment's reward() failed: %s: %s", type(e).__name__, e)
                out["env_reward"] = 0.0
        return out

    def _generate_fn(self, greedy: bool) -> Callable[[list[list[int]], list[int], list[int]], list[Generation]]:
        s = self.sampler
        st = s.settings
        sampling = Sampling(max_tokens=st.max_new_tokens, temperature=0.0 if greedy else st.temperature,
                            top_p=1.0 if greedy else st.top_p, top_k=-1 if greedy else st.top_k, n=1,
                            stop_token_ids=s.stop_ids)

        def generate(contexts: list[list[int]], budgets: list[int], seeds: list[int]) -> list[Generation]:
            return [g[0] for g in s.engine.generate(contexts, sampling, seeds, budgets)]

        return generate


def stats_of(t: Trajectory) -> dict[str, float]:
    """One trajectory's counts, as the metrics sum them."""
    model = t.model_tokens
    return {"n": 1.0, "turns": t.turns, "tool_calls": t.tool_calls, "calling": float(t.tool_calls > 0),
            "malformed": t.malformed_calls, "errors": t.tool_errors, "timeouts": t.tool_timeouts,
            "infra": float(t.infra_failed), "truncated": float(t.truncated), "model_tokens": model,
            "context_tokens": len(t.response_ids) - model}


_KEYS = ("n", "turns", "tool_calls", "calling", "malformed", "errors", "timeouts", "infra", "truncated", "model_tokens",
         "context_tokens", "tool_s", "generate_s", "trajectories")


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
