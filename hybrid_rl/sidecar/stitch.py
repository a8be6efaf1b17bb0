"""Recorded model calls stitched into trajectories by the append-only rule (black-box agents, issue 24 item 5).

An agent that talks to the model through a chat API sends, at each call, the whole conversation so far; the engine
saw it as token ids (`RecordedCall.prompt_ids`) and sampled `output_ids`. A call extends the trajectory in the making
when its prompt starts with everything that trajectory holds (its prompt, then every id since): the ids the agent
added in between (tool results, its own messages, the template's boundary tokens) are context (loss mask 0), the
sampled ids are the model's (mask 1, with their log-probs). A call that does not extend it (the agent rewrote or
dropped earlier turns, or started over) starts a new trajectory rather than corrupting one: the trainer then sees
only ids the engine saw, in the order it saw them. Every trajectory of an episode is trained; the last one carries the
episode's reward (`Sample.part`).

Each sampled id keeps the policy version that sampled it (`RecordedCall.versions`, asynchronous training); the
context ids an agent added take the version of the model id before them (they are not trained, and no version is
older than that of the turn they answer).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hybrid_rl.rollout.trajectory import Trajectory


@dataclass(frozen=True)
class RecordedCall:
    """One call as the engine saw it: the ids it was given, the ids it sampled and their log-probs."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    logprobs: Sequence[float]
    versions: Sequence[int] = ()  # the policy version of each output id; () when the server stamped none


def stitch(calls: Iterable[RecordedCall]) -> list[Trajectory]:
    """The calls of one agent episode, in the order they were made, as trajectories (most episodes: one)."""
    out: list[Trajectory] = []
    for c in calls:
        if len(c.output_ids) != len(c.logprobs):
            raise ValueError(f"a recorded call has {len(c.output_ids)} output ids but {len(c.logprobs)} log-probs")
        if c.versions and len(c.versions) != len(c.output_ids):
            raise ValueError(f"a recorded call has {len(c.output_ids)} output ids but {len(c.versions)} versions")
        current = out[-1] if out else None
        if current is None or not _continues(current, c.prompt_ids):
            current = Trajectory(list(c.prompt_ids))
            out.append(current)
        else:
            added = list(c.prompt_ids[len(current.context):])
            current.add_context(added)
            current.versions += current.versions[-1:] * len(added)
        current.add_model(list(c.output_ids), list(c.logprobs))
        current.versions += list(c.versions)
    for t in out:
        if len(t.versions) != len(t.response_ids):  # a call without versions: none recorded for the trajectory
            t.versions = []
    return out


def _continues(t: Trajectory, prompt_ids: Sequence[int]) -> bool:
    """Whether a call given `prompt_ids` extends `t`: everything `t` holds is a prefix of it."""
    context = t.context
    return len(prompt_ids) >= len(context) and list(prompt_ids[: len(context)]) == context
