"""Preference (DPO) datasets: string and conversation pairs, eos-terminated responses, length drops, errors."""

from __future__ import annotations

import pytest

from hybrid_rl.data import DatasetError, load_preference_dataset

PAIR = {"prompt": "What is 2 + 3?", "chosen": "The answer is 5.", "rejected": "The answer is 6."}


def _ids(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_string_pairs_tokenize_responses_alone_and_end_them_with_eos(tokenizer, write_jsonl):
    dataset = load_preference_dataset([write_jsonl([PAIR])], tokenizer, max_prompt_tokens=64, max_response_tokens=64)
    (record,) = dataset
    assert record.index == 0
    assert record.prompt_ids == _ids(tokenizer, PAIR["prompt"])
    assert record.chosen_ids == _ids(tokenizer, PAIR["chosen"]) + (tokenizer.eos_token_id,)
    assert record.rejected_ids == _ids(tokenizer, PAIR["rejected"]) + (tokenizer.eos_token_id,)


def test_ultrafeedback_style_conversations_use_the_template_prompt_and_the_last_reply(tokenizer, write_parquet):
    user = {"role": "user", "content": PAIR["prompt"]}
    row = {
        "prompt": PAIR["prompt"],
        "chosen": [user, {"role": "assistant", "content": PAIR["chosen"]}],
        "rejected": [{"role": "assistant", "content": PAIR["rejected"]}],  # the reply alone is accepted too
    }
    (record,) = load_preference_dataset(
        [write_parquet([row])], tokenizer, max_prompt_tokens=64, max_response_tokens=64, apply_chat_template=True
    )
    rendered = tokenizer.apply_chat_template([user], tokenize=True, add_generation_prompt=True)["input_ids"]
    assert record.prompt_ids == tuple(rendered)
    assert record.chosen_ids == _ids(tokenizer, PAIR["chosen"]) + (tokenizer.eos_token_id,)
    assert record.rejected_ids == _ids(tokenizer, PAIR["rejected"]) + (tokenizer.eos_token_id,)


def test_pairs_over_either_limit_are_dropped_and_counted(tokenizer, write_jsonl):
    long_reply = "The answer is " + " plus ".join(str(i) for i in range(30))
    rows = [PAIR, {**PAIR, "rejected": long_reply}, {**PAIR, "prompt": long_reply}]
    response_limit = len(_ids(tokenizer, PAIR["chosen"])) + 1  # + eos: the limit counts it
    dataset = load_preference_dataset(
        [write_jsonl(rows)],
        tokenizer,
        max_prompt_tokens=len(_ids(tokenizer, PAIR["prompt"])),
        max_response_tokens=response_limit,
    )
    assert [r.index for r in dataset] == [0]
    assert dataset.num_dropped_too_long == 2


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"prompt": "hi", "chosen": "yes"}, "missing 'rejected'"),
        ({**PAIR, "chosen": "  "}, "'chosen' is empty or only whitespace"),
        ({**PAIR, "rejected": {"text": "no"}}, "'rejected' is a dict"),
        (
            {**PAIR, "chosen": [{"role": "assistant", "content": "5"}]},
            "'chosen' is a chat conversation but the prompt is a plain string rendered without a chat template",
        ),
    ],
)
def test_a_bad_pair_names_its_file_and_line(tokenizer, write_jsonl, row, problem):
    path = write_jsonl([PAIR, row])
    with pytest.raises(DatasetError) as info:
        load_preference_dataset([path], tokenizer, max_prompt_tokens=64, max_response_tokens=64)
    assert str(info.value).startswith(f"{path} line 2: {problem}")


@pytest.mark.parametrize(
    ("chosen", "problem"),
    [
        ([{"role": "user", "content": "What is 2 + 3?"}], "the last message of 'chosen' is {'role': 'user'"),
        (
            [{"role": "user", "content": "What is 9 + 9?"}, {"role": "assistant", "content": "18"}],
            "the messages of 'chosen' before its reply differ from the prompt",
        ),
    ],
)
def test_a_conversation_must_end_with_the_reply_to_this_prompt(tokenizer, write_jsonl, chosen, problem):
    path = write_jsonl([{**PAIR, "chosen": chosen}])
    with pytest.raises(DatasetError) as info:
        load_preference_dataset(
            [path], tokenizer, max_prompt_tokens=64, max_response_tokens=64, apply_chat_template=True
        )
    assert str(info.value).startswith(f"{path} line 1: {problem}")
