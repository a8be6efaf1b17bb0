"""The tools demo's task: a product too long for a tiny model to work out in its head, which one `python` call answers.

    {"prompt": [{"role": "user", "content": "What is 347 * 829?"}], "ground_truth": "287663"}

The answer is scored by the math answer matcher (the last `\\boxed{}`). Both factors are 3 digits from 400 on, so
every product has 6 digits and every conversation of one kind has the same length: the tiny model only has to copy
digits from fixed places (the factors into the call, the tool's printed result into the box), which it can learn,
not multiply, which it cannot. A guess is right about one time in 840,000.

The supervised warm-up (`tools_warmup.py`) is deliberately imperfect: only `call_share` of its conversations call the
tool (a Qwen-style `<tool_call>` for `python`, the tool's output, then the boxed result); the others box a random
6-digit guess. The warmed-up model therefore calls the tool in about that share of its samples, and greedy decoding
(the held-out score) mostly guesses; what GRPO adds is calling it every time.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from hybrid_rl.demo.task import write_splits

QUESTION = "What is {a} * {b}?"
LOW, HIGH = 400, 999  # 400 * 400 = 160000: every product has 6 digits


def make_row(rng: random.Random) -> dict:
    a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
    return {"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "ground_truth": str(a * b)}


def write_tools_task(out_dir: str | Path, *, n_train: int, n_val: int, seed: int = 0) -> tuple[Path, Path]:
    """Write train.jsonl and val.jsonl (disjoint questions) under out_dir."""
    rng = random.Random(seed)
    return write_splits(out_dir, lambda: make_row(rng), lambda row: row["prompt"][0]["content"], n_train=n_train,
                        n_val=n_val)


def factors_of(question: str) -> tuple[int, int]:
    a, _, b = question.removeprefix("What is ").removesuffix("?").partition(" * ")
    return int(a), int(b)


def call_text(a: int, b: int) -> str:
    """The model's tool call, as the Qwen / Hermes template family writes one (`tool_calls.hermes` reads it)."""
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": f"print({a} * {b})"}}) + "</tool_call>"


def answer_text(value: int) -> str:
    return f"\\boxed{{{value}}}"


@dataclass(frozen=True)
class WarmupConversation:
    """One supervised target: with a tool call, (call, what the tool prints, boxed answer); without, (boxed guess,)."""

    question: str
    model_turns: tuple[str, ...]
    tool_output: str = ""  # the python tool's stdout (its print ends with a newline), as the loop appends it


def warmup_conversation(row: dict, rng: random.Random, *, call_share: float) -> WarmupConversation:
    question = row["prompt"][0]["content"]
    a, b = factors_of(question)
    if rng.random() < call_share:
        return WarmupConversation(question, (call_text(a, b), answer_text(a * b)), f"{a * b}\n")
    return WarmupConversation(question, (answer_text(rng.randint(LOW * LOW, HIGH * HIGH)),))


def read_rows(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]
