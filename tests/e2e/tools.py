"""Tool-call parsers and tools for the end-to-end tool runs (plugged in by import path)."""

from hybrid_rl.rollout.tool_calls import ToolCall


def always_python(text: str) -> list[ToolCall]:
    """Every turn calls the python tool (a random model never writes a call): the loop then runs for real."""
    return [ToolCall("python", {"code": f"print({len(text)} * 7)"})]


def python_and_tally(text: str) -> list[ToolCall]:
    """Every turn calls the python tool and the `Tally` environment's method."""
    return [*always_python(text), ToolCall("tally", {"text": text[-20:]})]


class Tally:
    """An environment for the tool runs (`rollout.environment`): its prompt names the row's answer (so `reset` got the
    row), `tally` counts its own calls, and the reward is that count: it reaches the scores only if the calls ran on
    this trajectory's instance and `reward()` was read from it."""

    def __init__(self):
        self.calls, self.row_seen = 0, False

    def reset(self, ground_truth: str = "", **row) -> str:
        self.calls, self.row_seen = 0, bool(ground_truth)
        return f"Say {ground_truth} after counting."

    def tally(self, text: str) -> int:
        """Count one more call.

        Args:
            text: Anything.
        """
        self.calls += 1
        return self.calls

    def reward(self) -> float:
        return float(self.calls) if self.row_seen else -100.0


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: The key.
    """
    return f"value of {key}"


def openai_agent(base_url: str, row: dict) -> float:
    """A black-box agent as users write one (`rollout.agent`): the OpenAI client, a tool it answers itself, then a
    conversation started over (not an extension: stitched as a second trajectory, trained too). Its reward: the first
    reply's parity."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": f"What is {row.get('ground_truth', '?')}?"}]
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=6).choices[0].message.content
    messages += [{"role": "assistant", "content": reply}, {"role": "tool", "name": "python", "content": "7"}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Again."}], max_tokens=4)
    return float(len(reply) % 2)


def always_add(text: str) -> list[ToolCall]:
    """Every turn calls the MCP test server's `add` (`tests/integration/rollout/mcp_server.py`)."""
    return [ToolCall("add", {"a": len(text), "b": 7})]


def always_check(text: str) -> list[ToolCall]:
    """Every turn calls the `Quiz` environment's `check`."""
    return [ToolCall("check", {"answer": len(text) % 10})]


class Quiz:
    """An environment that rewards each step and answers as the user (`EnvReply`): every `check` is worth 0.25 and
    comes back as the user's message."""

    rewards_per_turn = True

    def reset(self, **row):
        return None

    def check(self, answer: int):
        """Check an answer.

        Args:
            answer: The answer.
        """
        from hybrid_rl.rollout.tools import EnvReply

        return EnvReply(f"{answer}? Try again.", reward=0.25, role="user")


def schedules_agree(trainer) -> None:
    """Probe (`run_recipes.py`), before the run fits: one greedy rollout of the validation prompts with each multi-turn
    schedule (`rollout.multi_turn.schedule`) on the real engine and tools; each rank writes what it holds (uid, ids,
    loss mask, log-probs) to `schedules_rank<r>.json` in the run's folder, for the test to compare."""
    import dataclasses
    import json

    worker = trainer.c.rollout
    data = trainer.c.train_loader.dataset
    setup, records = worker.setup, trainer.c.val_records[:4] or [data[i] for i in range(min(4, len(data)))]
    held = {}
    try:
        with worker.session(0):
            for schedule in ("trajectory", "lockstep"):
                worker.setup = dataclasses.replace(setup, schedule=schedule)
                rollout = worker.generate(records, n=2, step=1, group_base=0, greedy=True)
                held[schedule] = [(s.uid, s.response_ids.tolist(), s.loss_mask.tolist(), s.rollout_logprobs.tolist())
                                  for s in rollout.held]
    finally:
        worker.setup = setup
    trainer.out.mkdir(parents=True, exist_ok=True)
    (trainer.out / f"schedules_rank{trainer.dims.rank}.json").write_text(json.dumps(held))
