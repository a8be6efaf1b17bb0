"""Prompt datasets: JSONL and Parquet loading, chat rendering, carried reward fields, over-long prompts."""

from __future__ import annotations

import copy
import logging
import pickle

import pytest

from hybrid_rl.data import DatasetError, PromptRecord, load_prompt_dataset

MATH_ROWS = [
    {"prompt": "What is 2 + 3?", "ground_truth": "5", "level": 1},
    {"prompt": [{"role": "user", "content": "What is 7 * 6?"}], "ground_truth": "42", "level": 2},
]


def test_jsonl_rows_become_records_in_file_order_with_reward_fields_untouched(tokenizer, write_jsonl):
    rows = [{"prompt": "add 1 and 2", "ground_truth": "3", "tests": ["assert f() == 3"], "meta": {"id": 7}}]
    dataset = load_prompt_dataset([write_jsonl(rows)], tokenizer, max_prompt_tokens=64)

    (record,) = dataset
    assert record.index == 0
    assert record.prompt_text == "add 1 and 2"
    assert record.prompt_ids == tuple(tokenizer("add 1 and 2")["input_ids"])
    assert dict(record.fields) == {"ground_truth": "3", "tests": ["assert f() == 3"], "meta": {"id": 7}}
    assert dataset.num_dropped_too_long == 0


def test_parquet_and_jsonl_with_the_same_rows_give_the_same_records(tokenizer, write_jsonl, write_parquet):
    rows = [{"prompt": [{"role": "user", "content": f"question {i}"}], "ground_truth": str(i)} for i in range(3)]
    from_jsonl = load_prompt_dataset([write_jsonl(rows)], tokenizer, max_prompt_tokens=64)
    from_parquet = load_prompt_dataset([write_parquet(rows)], tokenizer, max_prompt_tokens=64)
    assert from_jsonl.records == from_parquet.records


def test_several_files_are_concatenated_and_indexed_across_files(tokenizer, write_jsonl, write_parquet):
    files = [write_jsonl(MATH_ROWS[:1], "a.jsonl"), write_parquet(MATH_ROWS[1:], "b.parquet")]
    dataset = load_prompt_dataset(files, tokenizer, max_prompt_tokens=64)
    assert [r.index for r in dataset] == [0, 1]
    assert [r.fields["ground_truth"] for r in dataset] == ["5", "42"]


def test_chat_messages_are_rendered_with_the_template_and_a_generation_prompt(tokenizer, write_jsonl):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 * 6?"}]
    (record,) = load_prompt_dataset([write_jsonl([{"prompt": messages}])], tokenizer, max_prompt_tokens=64)

    assert record.prompt_text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 7 * 6?<|im_end|>\n<|im_start|>assistant\n"
    )
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert record.prompt_ids == tuple(expected)


def test_string_prompts_skip_the_template_unless_asked(tokenizer, write_jsonl):
    path = write_jsonl([{"prompt": "What is 2 + 3?"}])
    (raw,) = load_prompt_dataset([path], tokenizer, max_prompt_tokens=64)
    (chat,) = load_prompt_dataset([path], tokenizer, max_prompt_tokens=64, apply_chat_template=True)

    assert raw.prompt_text == "What is 2 + 3?"
    assert chat.prompt_text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"


def test_apply_chat_template_without_a_template_is_refused(tokenizer_without_template, write_jsonl):
    with pytest.raises(ValueError, match="no chat template"):
        load_prompt_dataset(
            [write_jsonl(MATH_ROWS[:1])], tokenizer_without_template, max_prompt_tokens=64, apply_chat_template=True
        )


def test_a_custom_prompt_key_is_read_and_left_out_of_fields(tokenizer, write_jsonl):
    path = write_jsonl([{"question": "What is 2 + 3?", "answer": "5"}])
    (record,) = load_prompt_dataset([path], tokenizer, max_prompt_tokens=64, prompt_key="question")
    assert record.prompt_text == "What is 2 + 3?"
    assert dict(record.fields) == {"answer": "5"}


def test_prompts_over_the_limit_are_dropped_counted_and_warned_once(tokenizer, write_jsonl, caplog):
    short, long = "What is 2 + 3?", "What is " + " plus ".join(str(i) for i in range(40)) + "?"
    limit = len(tokenizer(short)["input_ids"])
    assert len(tokenizer(long)["input_ids"]) > limit
    path = write_jsonl([{"prompt": long}, {"prompt": short}, {"prompt": long}])

    with caplog.at_level(logging.WARNING, logger="hybrid_rl.data.datasets"):
        dataset = load_prompt_dataset([path], tokenizer, max_prompt_tokens=limit)

    assert [r.index for r in dataset] == [1]  # kept, never truncated, and keeps its source index
    assert dataset[0].prompt_text == short
    assert dataset.num_dropped_too_long == 2
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "dropped 2 of 3" in warning.getMessage() and f"max_prompt_tokens={limit}" in warning.getMessage()


def test_a_prompt_exactly_at_the_limit_is_kept(tokenizer, write_jsonl):
    prompt = "What is 2 + 3?"
    limit = len(tokenizer(prompt)["input_ids"])
    dataset = load_prompt_dataset([write_jsonl([{"prompt": prompt}])], tokenizer, max_prompt_tokens=limit)
    assert len(dataset) == 1 and dataset.num_dropped_too_long == 0


def test_every_prompt_over_the_limit_is_an_error_not_an_empty_dataset(tokenizer, write_jsonl):
    with pytest.raises(DatasetError, match="all 1 rows .* exceed max_prompt_tokens=1"):
        load_prompt_dataset([write_jsonl(MATH_ROWS[:1])], tokenizer, max_prompt_tokens=1)


def test_fields_are_read_only_and_records_survive_pickle_and_deepcopy(tokenizer, write_jsonl):
    (record,) = load_prompt_dataset([write_jsonl(MATH_ROWS[:1])], tokenizer, max_prompt_tokens=64)
    with pytest.raises(TypeError):
        record.fields["ground_truth"] = "6"  # type: ignore[index]
    assert pickle.loads(pickle.dumps(record)) == record
    assert copy.deepcopy(record) == record
    assert isinstance(record, PromptRecord)
