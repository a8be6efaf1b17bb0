"""The multi-turn loop: turns in lockstep over a batch of trajectories, tools in between, everything as token ids.

Each turn sends the still-active trajectories' ids to the engine (one request each, its remaining response budget,
or `max_turn_tokens` if less, as its token limit), appends the sampled ids and log-probs, parses the tool calls of the turn's text, runs all the
batch's calls at once in the tool runner, and appends each result as the chat template's suffix
(`chat_template.ToolSuffix`). A trajectory ends when a turn has no tool call (calls written inside the family's
reasoning block do not count), at `max_turns` model turns, when its response budget is spent (a tool result that would not fit ends it
before being appended: never cut mid-token), or when a tool's infrastructure fails (then it is marked, and the
rollout drops it). Calls past `max_tool_calls` are answered with the limit's error message, not run; a turn cut
by `max_turn_tokens` is parsed as any other and marks the trajectory truncated.

With an environment that has a user simulator (`respond`), a model turn without calls is answered by it as the
user's next message (None ends the dialogue); an environment's method may return an `EnvReply` with a reward for
that step (kept per model turn, `Trajectory.turn_rewards`) or speaking as the user.

Colocated at TP > 1 the ranks of a vLLM group hold the same trajectories and must send identical requests: each
trajectory's calls run on one of them (a `ToolShare` says which), and the group exchanges the answers, the tool
messages' ids with them, so that every rank appends the same ids.

The engine is a function (`Generate`), so this loop is the same for any engine that takes token ids.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybrid_rl.rollout.chat_template import ToolSuffix
from hybrid_rl.rollout.tool_calls import ToolCall, typed
from hybrid_rl.rollout.tools._worker import ERROR, INFRA, TIMEOUT
from hybrid_rl.rollout.tools.runner import ToolRequest, ToolResult, ToolRunner
from hybrid_rl.rollout.tools.spec import RESPOND
from hybrid_rl.rollout.trajectory import Trajectory
from hybrid_rl.types import Generation

# (contexts, max new tokens of each, seeds) -> one generation per context
Generate = Callable[[list[list[int]], list[int], list[int]], list[Generation]]

TRUNCATION_MARKER = "\n...[{n} tokens truncated]...\n"
TURN_SEED_STRIDE = 1_000_003  # turn t of a trajectory draws with seed + t * stride
USER_TURN = "user-turn"  # the id of the loop's own call to an environment's user simulator (`respond`)


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int  # model turns per trajectory
    max_tool_calls: int  # tool calls per trajectory
    max_tool_response_tokens: int  # one tool result, cut in the middle beyond this
    max_response_tokens: int  # the whole trajectory after the prompt: model and context tokens
    max_turn_tokens: int = 0  # one model turn (0: what is left of the budget); a turn cut here is parsed as any other


@dataclass
class LoopStats:
    tool_seconds: float = 0.0  # wall time waiting on tools
    generate_seconds: float = 0.0
    turns: int = 0  # lockstep turns run
    tool_restarts: int = 0
    per_call_seconds: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class ToolAnswer:
    """One trajectory's calls of one turn, answered: the results, and the tool messages' ids (the template's suffix;
    none after an infrastructure failure). What the ranks of a TP group exchange: each applies them alike."""

    results: tuple[ToolResult, ...]
    ids: tuple[int, ...]


class ToolShare(Protocol):
    """Whose tools a rank runs when several ranks hold the same trajectories (the ranks of a colocated vLLM TP
    group, which must send the engine identical requests): each runs its own, then they exchange."""

    def owns(self, i: int) -> bool:
        """Whether this rank runs trajectory `i`'s tools (and holds its environment)."""

    def exchange(self, mine: dict[int, Any], check: int) -> dict[int, Any]:
        """Every rank's `mine` merged (keys: trajectory positions); `check` must be the same on every rank. Collective
        over the group."""


def digest(trajectories: Sequence[Trajectory]) -> int:
    """A fingerprint of the trajectories' ids and states: equal on the ranks of a TP group, or they went apart."""
    return hash(tuple((tuple(t.context), t.done) for t in trajectories))


def merge_parts(parts: Sequence[tuple[int, dict[int, Any]]]) -> dict[int, Any]:
    """The exchange's result from every rank's (check, mine): one dict, each key from the one rank that owns it.

    A check that differs means the ranks no longer hold the same trajectories (the engine sampled differently on
    them): the group's next requests would differ, so stop here with a clear error rather than hang in the engine."""
    checks = {c for c, _ in parts}
    if len(checks) != 1:
        raise RuntimeError(f"the ranks of a vLLM TP group hold different multi-turn trajectories (fingerprints "
                           f"{[c for c, _ in parts]}): their engines sampled differently, so their next requests "
                           "would differ")
    out: dict[int, Any] = {}
    for rank, (_, mine) in enumerate(parts):
        if twice := out.keys() & mine.keys():
            raise RuntimeError(f"trajectories {sorted(twice)} were answered by two ranks of a TP group (rank {rank} "
                               "among them): each trajectory's tools must run once")
        out.update(mine)
    return out


class ToolLoop:
    def __init__(self, tokenizer, suffix: ToolSuffix, parser: Callable[[str], list[ToolCall]], runner: ToolRunner,
                 limits: TurnLimits):
        self.tokenizer, self.suffix, self.parser, self.runner, self.limits = tokenizer, suffix, parser, runner, limits
        # an environment with a user simulator answers model turns without calls (`respond`)
        self.user_turns = RESPOND in runner.env_methods

    def run(self, trajectories: Sequence[Trajectory], envs: Sequence[object | None], generate: Generate,
            seeds: Sequence[int], share: ToolShare | None = None) -> LoopStats:
        """Play every trajectory to its end (in place). `share`: see `answer` (with one, the group exchanges at
        every turn, calls or not, so its ranks check they still hold the same trajectories before generating)."""
        stats = LoopStats()
        lim = self.limits
        for turn in range(lim.max_turns):
            active = [i for i, t in enumerate(trajectories) if not t.done]
            if not active:
                break
            stats.turns += 1
            start = time.monotonic()
            gens = generate([trajectories[i].context for i in active], [self.turn_budget(trajectories[i]) for i in active],
                            [seeds[i] + turn * TURN_SEED_STRIDE for i in active])
            stats.generate_seconds += time.monotonic() - start
            pending: list[tuple[int, list[ToolCall], bool]] = []
            for i, g in zip(active, gens, strict=True):
                if (calls := self.model_turn(trajectories[i], g)) is not None:
                    pending.append((i, *calls))
            if pending or share is not None:
                start = time.monotonic()
                self.answer(trajectories, envs, pending, stats, share)
                stats.tool_seconds += time.monotonic() - start
        for t in trajectories:
            t.done = True
        stats.tool_restarts = self.runner.restarts
        return stats

    def model_turn(self, t: Trajectory, g: Generation) -> tuple[list[ToolCall], bool] | None:
        """Append a model turn; (its tool calls, whether it ended on the end-of-turn token) when tools must answer,
        None when the trajectory ended."""
        lim = self.limits
        t.add_model(list(g.token_ids), list(g.logprobs))
        if g.finish_reason == "length" and len(t.response_ids) >= lim.max_response_tokens:
            t.truncated, t.done = True, True
            return None
        if g.finish_reason == "length":
            t.truncated = True  # cut by max_turn_tokens: parsed as any other turn, but marked
        ended = bool(g.token_ids) and int(g.token_ids[-1]) == self.suffix.end_of_turn_id
        # special tokens kept (Mistral's [TOOL_CALLS] is one), the end-of-turn token not
        text = self.tokenizer.decode(list(g.token_ids)[: -1 if ended else None], skip_special_tokens=False)
        answer = self.suffix.family.answer_text(text)
        calls = [typed(c, self.suffix.tools) for c in self.parser(answer)]  # a call inside the reasoning is a thought
        # past max_tool_calls the calls are still answered (with the limit's error), so the model learns the limit
        if t.turns >= lim.max_turns or not (calls or self.user_turns):
            t.done = True
            return None
        return calls or [ToolCall(RESPOND, {"message": answer}, id=USER_TURN)], ended

    def turn_budget(self, t: Trajectory) -> int:
        left = self.limits.max_response_tokens - len(t.response_ids)
        return min(left, self.limits.max_turn_tokens) if self.limits.max_turn_tokens else left

    def answer(self, trajectories: Sequence[Trajectory], envs: Sequence[object | None],
               pending: list[tuple[int, list[ToolCall], bool]], stats: LoopStats, share: ToolShare | None = None) -> None:
        """Run every pending call of the turn at once; append each trajectory's results as one suffix.

        With a `share` (colocated TP > 1) this rank runs the calls of the trajectories it owns, then the group
        exchanges the answers (and checks it holds the same trajectories), so every rank appends the same ids."""
        owned = pending if share is None else [p for p in pending if share.owns(p[0])]
        answers = self.run_calls(trajectories, envs, owned)
        if share is not None:
            answers = share.exchange(answers, digest(trajectories))
        for i, calls, _ in pending:
            self.apply(trajectories[i], calls, answers[i], stats)

    def run_calls(self, trajectories: Sequence[Trajectory], envs: Sequence[object | None],
                  pending: list[tuple[int, list[ToolCall], bool]]) -> dict[int, ToolAnswer]:
        """Every pending call run at once in the runner; each trajectory's answer (its results and their ids)."""
        requests, owners = [], []
        for i, calls, _ in pending:
            mine = self.requests_of(trajectories[i], envs[i], calls)
            requests += mine
            owners += [i] * len(mine)
        results = self.runner.run(requests) if requests else []
        by_owner: dict[int, list[ToolResult]] = {}
        for i, res in zip(owners, results, strict=True):
            by_owner.setdefault(i, []).append(res)
        return {i: self.answer_of(trajectories[i], calls, ended, by_owner[i]) for i, calls, ended in pending}

    def requests_of(self, t: Trajectory, env: object | None, calls: list[ToolCall]) -> list[ToolRequest]:
        """The runner's requests for one trajectory's calls of a turn (past the limit or not the model's to make:
        answered with an error, not run)."""
        room = self.limits.max_tool_calls - t.tool_calls
        out = []
        for k, c in enumerate(calls):
            if c.name == RESPOND and c.id != USER_TURN:  # the user simulator is not the model's to call
                c = ToolCall(c.name, c.arguments, error=f"unknown tool {RESPOND!r}")
            elif k >= room and c.id != USER_TURN:  # answered without running: the model learns the limit
                c = ToolCall(c.name, c.arguments, error=f"the limit of {self.limits.max_tool_calls} tool calls "
                                                        "per conversation is reached")
            out.append(ToolRequest(c, env))
        return out

    def answer_of(self, t: Trajectory, calls: list[ToolCall], ended: bool, answered: list[ToolResult]) -> ToolAnswer:
        """One trajectory's answer from its calls' results: the tool messages' ids (none after an infrastructure
        failure or the end of a dialogue)."""
        if any(r.status == INFRA or r.role == "end" for r in answered):
            return ToolAnswer(tuple(answered), ())
        first = t.tool_calls
        messages = [{"role": "user", "content": self._cut(r.text)} if r.role == "user" else
                    self.suffix.tool_message(c, self._cut(r.text), first + k)
                    for k, (c, r) in enumerate(zip(calls, answered, strict=True))]
        return ToolAnswer(tuple(answered), tuple(self.suffix.ids(messages, ended=ended)))

    def apply(self, t: Trajectory, calls: list[ToolCall], answer: ToolAnswer, stats: LoopStats) -> None:
        """Append a trajectory's answered calls: counts, the log the reward reads, the tool messages' ids (unless a
        tool's infrastructure failed, or they would overflow the budget: then the trajectory ends)."""
        answered = list(zip(calls, answer.results, strict=True))
        stats.per_call_seconds += [r.seconds for r in answer.results]
        t.tool_calls += sum(1 for c in calls if c.id != USER_TURN)
        t.user_turns += sum(1 for c, r in answered if c.id == USER_TURN and r.role != "end")
        t.turn_rewards[-1] += sum(r.reward for r in answer.results)
        t.malformed_calls += sum(1 for c, _ in answered if c.error and not c.name)
        t.tool_errors += sum(1 for _, r in answered if r.status == ERROR)
        t.tool_timeouts += sum(1 for _, r in answered if r.status == TIMEOUT)
        t.log += [{"name": c.name, "arguments": c.arguments, "status": r.status, "result": r.text[:2000],
                   **({"reward": r.reward} if r.reward else {})}
                  for c, r in answered if c.id != USER_TURN]
        if any(r.status == INFRA for _, r in answered):
            t.infra_failed, t.done = True, True
            return
        if any(r.role == "end" for _, r in answered):  # the user simulator ended the dialogue
            t.done = True
            return
        if len(t.response_ids) + len(answer.ids) >= self.limits.max_response_tokens:
            t.truncated, t.done = True, True  # no room for the result and a reply: end here, nothing cut
            return
        t.add_context(list(answer.ids))

    def _cut(self, text: str) -> str:
        """A tool result of at most `max_tool_response_tokens` tokens: the middle replaced by a marker."""
        keep = self.limits.max_tool_response_tokens
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= keep:
            return text
        head = keep // 2
        return (self.tokenizer.decode(ids[:head]) + TRUNCATION_MARKER.format(n=len(ids) - keep)
                + self.tokenizer.decode(ids[len(ids) - (keep - head):]))
