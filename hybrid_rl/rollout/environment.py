"""An environment's life with one trajectory (`rollout.environment`), the same in both deployments.

`open_environment`: a new instance, `reset(**row)` with the dataset row's fields, and the trajectory's prompt ids
(the row's, or those of the prompt `reset` returned, rendered with the tools). An environment that cannot start
(its constructor, `reset` or the rendering of its prompt raises) is an infrastructure failure of that trajectory
(dropped from the step, counted), not a crash of the run. `trajectory_fields`: what the reward may judge at the end,
the calls made, the per-turn rewards and the environment's reward (its `reward()` plus their sum).

The instance lives where its trajectory's tools run (`tools.runner.ToolRunner` calls its methods): in sidecar mode
the trajectory's thread; colocated, the rank that owns the trajectory (at TP > 1 its sample's holder in its group).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_rl.rollout.tools import Environment
from hybrid_rl.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Opening:
    """How a trajectory starts (what the ranks of a TP group exchange: it pickles; the instance stays home)."""

    prompt_ids: tuple[int, ...]
    own_prompt: bool = False  # the environment's reset returned the prompt (not the row's)
    error: str = ""  # the environment could not start: the trajectory is an infrastructure failure


def open_environment(spec: Environment | None, tokenizer, tools: Sequence[dict] | None, fields: Mapping[str, Any],
                     prompt_ids: Sequence[int], max_prompt_tokens: int = 0) -> tuple[Any, Opening]:
    """(the trajectory's environment instance or None, its opening); `prompt_ids`: the row's. A prompt of its own
    longer than `max_prompt_tokens` (`data.max_prompt_tokens`, what the engine was sized for; 0: no limit) fails the
    opening, as a dataset row that long is dropped."""
    if spec is None:
        return None, Opening(tuple(prompt_ids))
    try:
        env = spec.new()
        prompt = env.reset(**dict(fields))
        if prompt is None:
            return env, Opening(tuple(prompt_ids))
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False,
                                             add_generation_prompt=True)
        ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    except Exception as e:  # noqa: BLE001 - user code: that trajectory fails, loudly, not the run
        return None, _failed(prompt_ids, f"the environment could not start ({spec.cls.__name__}.reset or its prompt): "
                                         f"{type(e).__name__}: {e}")
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
        return None, _failed(prompt_ids, f"the prompt {spec.cls.__name__}.reset returned is {len(ids)} tokens, over "
                                         f"data.max_prompt_tokens={max_prompt_tokens}")
    return env, Opening(ids, own_prompt=True)


def _failed(prompt_ids: Sequence[int], why: str) -> Opening:
    log.warning("%s", why)
    return Opening(tuple(prompt_ids), error=why)


def trajectory_fields(spec: Environment | None, env: Any, t: Trajectory) -> dict[str, Any]:
    """The reward's extra fields: the calls made (`tool_calls`), the steps' rewards per model turn (`turn_rewards`)
    and, with an environment that rewards, `env_reward`: its `reward()` (read once the trajectory ended; 0 if it
    raises or has none) plus the sum of the per-turn rewards."""
    out: dict[str, Any] = {"tool_calls": list(t.log), "turn_rewards": list(t.turn_rewards)}
    if env is not None and spec is not None and spec.has_reward and not t.infra_failed:
        final = 0.0
        if callable(getattr(env, "reward", None)):
            try:
                final = float(env.reward())
            except Exception as e:  # noqa: BLE001 - the environment is user code: its failure scores 0, loudly
                log.warning("the environment's reward() failed: %s: %s", type(e).__name__, e)
        out["env_reward"] = final + sum(t.turn_rewards)  # the outcome plus every step's reward
    return out
