"""Small-number arithmetic as chat prompts: a task a real 135M instruct model gets partly right.

Each row is one user turn, rendered by the model's own chat template when the data is loaded, with the
answer scored by the math answer matcher (its last-number rule reads "3 + 4 = 7" as 7):

    {"prompt": [{"role": "user", "content": "What is 13 + 8? Answer with just the number."}], "ground_truth": "21"}

SmolLM2-135M-Instruct answers about a third to a half of these right greedily (it often restates the
question or drops a carry), so GRPO has signal from the first step. Used by `recipes/smollm2_arithmetic.yaml`
and the SmolLM2 tests.

    python -m hybrid_rl.demo.arithmetic OUT_DIR [--train 600] [--val 64]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from hybrid_rl.demo.task import write_splits

QUESTION = "What is {a} {op} {b}? Answer with just the number."


def make_row(rng: random.Random, *, max_operand: int = 20) -> dict:
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    op = rng.choice("+-")
    answer = a + b if op == "+" else a - b
    return {"prompt": [{"role": "user", "content": QUESTION.format(a=a, op=op, b=b)}], "ground_truth": str(answer)}


def write_arithmetic(out_dir: str | Path, *, n_train: int, n_val: int, seed: int = 0,
                     max_operand: int = 20) -> tuple[Path, Path]:
    """Write train.jsonl and val.jsonl (disjoint questions) under out_dir."""
    space = 2 * max_operand**2
    if n_train + n_val > space:
        raise ValueError(f"only {space} distinct questions with operands up to {max_operand}; "
                         f"asked for {n_train + n_val}")
    rng = random.Random(seed)
    return write_splits(out_dir, lambda: make_row(rng, max_operand=max_operand),
                        lambda row: row["prompt"][0]["content"], n_train=n_train, n_val=n_val)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=600)
    p.add_argument("--val", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    for path in write_arithmetic(a.out_dir, n_train=a.train, n_val=a.val, seed=a.seed):
        print(path)


if __name__ == "__main__":
    main()
