"""A synthetic task a tiny model can learn by RL on two CPU cores in minutes.

Each prompt lists six distinct digits and asks for the one at a given position:

    Digits: 3 8 1 6 9 5. Which is third?

and the answer is boxed (`\\boxed{1}`), scored by the math answer matcher against `ground_truth`.
The supervised warm-up teaches only the *format*: its targets box a digit from the list chosen at
random, so the warmed-up model answers in format but is right about one time in six. Whatever it
learns beyond that (reading the position and copying the right digit) comes from RL.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Hashable
from pathlib import Path

ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"]


def make_row(rng: random.Random, *, positions: int = 6, fixed_position: int | None = None) -> dict:
    digits = rng.sample(range(1, 10), positions)
    k = fixed_position if fixed_position is not None else rng.randrange(positions)
    prompt = f"Digits: {' '.join(map(str, digits))}. Which is {ORDINALS[k]}?"
    return {"prompt": prompt, "ground_truth": str(digits[k]), "numbers": digits}


def numbers_of(prompt: str) -> list[int]:
    return [int(x) for x in prompt.split(":")[1].split(".")[0].split()]


def warmup_target(row: dict, rng: random.Random) -> str:
    """A format-only supervised target: a random digit of the list, boxed."""
    return f" \\boxed{{{rng.choice(row['numbers'])}}}"


def write_task(out_dir: str | Path, *, n_train: int, n_val: int, seed: int = 0,
               fixed_position: int | None = None) -> tuple[Path, Path]:
    """Write train.jsonl and val.jsonl (disjoint prompts) under out_dir."""
    rng = random.Random(seed)

    def draw() -> dict:
        row = make_row(rng, fixed_position=fixed_position)
        return {"prompt": row["prompt"], "ground_truth": row["ground_truth"]}

    return write_splits(out_dir, draw, lambda row: row["prompt"], n_train=n_train, n_val=n_val)


def write_splits(out_dir: str | Path, draw: Callable[[], dict], key: Callable[[dict], Hashable], *, n_train: int,
                 n_val: int) -> tuple[Path, Path]:
    """Rows from `draw()` until n_train + n_val distinct ones (by `key`): the first n_train to train.jsonl, the rest
    to val.jsonl under out_dir, so no held-out prompt is also a training prompt."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, seen = [], set()
    while len(rows) < n_train + n_val:
        row = draw()
        if key(row) not in seen:
            seen.add(key(row))
            rows.append(row)
    paths = out / "train.jsonl", out / "val.jsonl"
    for path, part in zip(paths, (rows[:n_train], rows[n_train:]), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths
