"""The tools demo's task and warm-up layout: products with 6-digit answers, disjoint splits, and warm-up
conversations laid out as token ids exactly as the multi-turn rollout lays trajectories out."""

import json
import random

from hybrid_rl.demo.tools_task import (
    WarmupConversation,
    answer_text,
    call_text,
    factors_of,
    warmup_conversation,
    write_tools_task,
)
from hybrid_rl.demo.tools_warmup import conversation_ids
from hybrid_rl.model.tiny import build_tokenizer
from hybrid_rl.rewards.math import score
from hybrid_rl.rollout.chat_template import ToolSuffix, detect_family
from hybrid_rl.rollout.tool_calls import ToolCall, hermes


def test_rows_are_products_with_six_digit_answers_and_disjoint_splits(tmp_path):
    train, val = write_tools_task(tmp_path, n_train=300, n_val=40, seed=1)
    rows = {p.name: [json.loads(x) for x in p.read_text().splitlines()] for p in (train, val)}
    questions = {name: {r["prompt"][0]["content"] for r in rs} for name, rs in rows.items()}
    assert len(questions["train.jsonl"]) == 300 and not questions["train.jsonl"] & questions["val.jsonl"]
    for r in rows["train.jsonl"] + rows["val.jsonl"]:
        a, b = factors_of(r["prompt"][0]["content"])
        assert r["ground_truth"] == str(a * b) and len(r["ground_truth"]) == 6
        assert score(answer_text(a * b), r["ground_truth"]) == 1.0


def test_the_call_is_a_hermes_python_call_and_the_mix_calls_in_its_share():
    assert hermes(call_text(347, 829)) == [ToolCall("python", {"code": "print(347 * 829)"})]
    rng = random.Random(0)
    row = {"prompt": [{"role": "user", "content": "What is 400 * 500?"}], "ground_truth": "200000"}
    convs = [warmup_conversation(row, rng, call_share=0.3) for _ in range(2000)]
    calls = [c for c in convs if len(c.model_turns) == 2]
    assert 0.25 < len(calls) / len(convs) < 0.35
    assert calls[0] == WarmupConversation("What is 400 * 500?", (call_text(400, 500), "\\boxed{200000}"), "200000\n")


def test_warmup_ids_are_the_rollouts_layout_and_the_mask_is_the_models_turns():
    tok = build_tokenizer()
    suffix = ToolSuffix(tok, detect_family(tok.chat_template))
    conv = WarmupConversation("What is 347 * 829?", (call_text(347, 829), answer_text(287663)), "287663\n")
    ids, mask = conversation_ids(tok, suffix, conv)
    messages = [{"role": "user", "content": conv.question}, {"role": "assistant", "content": conv.model_turns[0]},
                {"role": "tool", "content": conv.tool_output}, {"role": "assistant", "content": conv.model_turns[1]}]
    # the template's rendering of the whole conversation, but for the newline after the last end-of-turn
    assert tok.decode(ids) + "\n" == tok.apply_chat_template(messages, tokenize=False)
    own = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(own) == f"{conv.model_turns[0]}<|im_end|>{conv.model_turns[1]}<|im_end|>"
