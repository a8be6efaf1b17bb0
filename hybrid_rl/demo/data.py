"""Preference pairs for the demo task (for the DPO recipe): the right answer chosen, a wrong one rejected."""

from __future__ import annotations

import json
import random
from pathlib import Path

from hybrid_rl.demo.task import numbers_of


def write_preferences(prompts_file: str | Path, out_file: str | Path, *, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(prompts_file) as f, open(out_file, "w") as out:
        for line in f:
            row = json.loads(line)
            wrong = rng.choice([n for n in numbers_of(row["prompt"]) if str(n) != row["ground_truth"]])
            out.write(json.dumps({"prompt": row["prompt"], "chosen": f" \\boxed{{{row['ground_truth']}}}",
                                  "rejected": f" \\boxed{{{wrong}}}"}) + "\n")
    return Path(out_file)
