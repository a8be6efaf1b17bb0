"""Convert GSM8K (a local copy: parquet or JSONL with `question` and `answer`) to hybrid_rl's prompt format.

    python -m hybrid_rl.data.gsm8k path/to/gsm8k/main/train-00000-of-00001.parquet gsm8k_train.jsonl

Each output row is `{"prompt": [chat messages], "ground_truth": "72"}`: the question as one user turn
(rendered with the model's chat template at load time) and the number after GSM8K's `####`.
Nothing is downloaded: fetch the dataset yourself (e.g. `hf download openai/gsm8k
--repo-type dataset --local-dir gsm8k`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."


def convert_row(row: dict) -> dict:
    answer = str(row["answer"]).split("####")[-1].strip().replace(",", "")
    return {"prompt": [{"role": "user", "content": f"{row['question'].strip()}\n{INSTRUCTION}"}],
            "ground_truth": answer}


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path)
    p.add_argument("out", type=Path)
    a = p.parse_args(argv)
    rows = read_rows(a.source)
    with open(a.out, "w") as f:
        for row in rows:
            f.write(json.dumps(convert_row(row)) + "\n")
    print(f"wrote {len(rows)} prompts to {a.out}")


if __name__ == "__main__":
    main()
