"""The SmolLM2 recipe's task: chat-formatted arithmetic rows, rendered through the tokenizer's chat template."""

import json
import re

import pytest

from hybrid_rl.data.datasets import load_prompt_dataset
from hybrid_rl.demo.arithmetic import write_arithmetic
from hybrid_rl.rewards.math import score


def test_rows_are_chat_turns_with_correct_answers_and_disjoint_splits(tmp_path):
    train, val = write_arithmetic(tmp_path, n_train=200, n_val=40, seed=3)
    rows = {name: [json.loads(x) for x in p.read_text().splitlines()] for name, p in (("train", train), ("val", val))}
    assert len(rows["train"]) == 200 and len(rows["val"]) == 40
    questions = {name: {r["prompt"][0]["content"] for r in rs} for name, rs in rows.items()}
    assert not questions["train"] & questions["val"] and len(questions["train"]) == 200
    ops = set()
    for r in rows["train"] + rows["val"]:
        assert [m["role"] for m in r["prompt"]] == ["user"]
        a, op, b = re.match(r"What is (\d+) ([+-]) (\d+)\?", r["prompt"][0]["content"]).groups()
        ops.add(op)
        assert int(r["ground_truth"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        # The reward reads a model's usual reply form.
        assert score(f"{a} {op} {b} = {r['ground_truth']}", r["ground_truth"]) == 1.0
    assert ops == {"+", "-"}
    with pytest.raises(ValueError, match="distinct questions"):
        write_arithmetic(tmp_path / "x", n_train=800, n_val=1)


def test_prompts_go_through_the_chat_template(tmp_path, tokenizer):
    _, val = write_arithmetic(tmp_path, n_train=4, n_val=4)
    ds = load_prompt_dataset([str(val)], tokenizer, max_prompt_tokens=512, required_keys=("ground_truth",))
    for rec in ds.records:
        assert rec.prompt_text.startswith("<|im_start|>user\nWhat is ") and rec.prompt_text.endswith(
            "<|im_start|>assistant\n")
