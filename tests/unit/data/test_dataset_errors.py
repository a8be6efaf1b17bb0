"""Every malformed input fails at load with a DatasetError naming the file, the line (or row) and what is expected."""

from __future__ import annotations

import pytest

from hybrid_rl.data import DatasetError, load_prompt_dataset

GOOD = {"prompt": "What is 2 + 3?", "ground_truth": "5"}


def _load_error(files, tokenizer, **kwargs) -> str:
    with pytest.raises(DatasetError) as info:
        load_prompt_dataset(files, tokenizer, max_prompt_tokens=64, **kwargs)
    return str(info.value)


@pytest.mark.parametrize(
    ("bad_line", "problem", "expected"),
    [
        ('{"prompt": "What is 2 +', "malformed JSON", "one JSON object per line"),
        ('["What is 2 + 3?"]', "is a JSON list, not an object", "one JSON object per line"),
        ('{"question": "What is 2 + 3?", "ground_truth": "5"}', "missing 'prompt'", "non-empty string"),
        ('{"prompt": null, "ground_truth": "5"}', "missing 'prompt'", "non-empty string"),
        ('{"prompt": "   \\n ", "ground_truth": "5"}', "empty or only whitespace", "non-empty string"),
        ('{"prompt": 42, "ground_truth": "5"}', "'prompt' is a int", "list of {'role': str, 'content': str}"),
        ('{"prompt": [], "ground_truth": "5"}', "'prompt' is an empty list", "chat messages"),
        ('{"prompt": ["What is 2 + 3?"], "ground_truth": "5"}', "prompt[0] is 'What is 2 + 3?'", "'role': str"),
        ('{"prompt": [{"role": "user"}], "ground_truth": "5"}', "prompt[0] is {'role': 'user'}", "'content': str"),
        (
            '{"prompt": [{"role": "user", "content": [{"type": "text"}]}], "ground_truth": "5"}',
            "prompt[0] is",
            "'content': str",
        ),
        ('{"prompt": [{"role": "user", "content": " "}], "ground_truth": "5"}', "every message", "non-empty"),
        ('{"prompt": "What is 2 + 3?"}', "missing required key 'ground_truth'", "a 'ground_truth' value"),
        ('{"prompt": "q", "ground_truth": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply",
         "nested at most 100 levels"),  # past the parser's recursion limit: a RecursionError inside json
        ('{"prompt": "q", "ground_truth": ' + "[" * 150 + "]" * 150 + "}", "nested more than 100 levels",
         "nested at most 100 levels"),  # parsed, but whoever walks it next would recurse as deep
    ],
)
def test_a_bad_jsonl_row_names_its_file_and_line(tokenizer, write_jsonl, bad_line, problem, expected):
    # Line 2 is blank: line numbers are the editor's, blank lines included.
    path = write_jsonl([GOOD, "", bad_line, GOOD])
    message = _load_error([path], tokenizer, required_keys=("ground_truth",))
    location, rest = message.split(": ", 1)
    what, expectation = rest.split("; expected ", 1)
    assert location == f"{path} line 3"
    assert problem in what
    assert expected in expectation


def test_a_bad_parquet_row_names_its_file_and_0_based_row(tokenizer, write_parquet):
    path = write_parquet([GOOD, {"prompt": None, "ground_truth": "5"}])
    message = _load_error([path], tokenizer)
    assert message.startswith(f"{path} row 1 (0-based): missing 'prompt'")


def test_a_missing_file_is_named(tokenizer, tmp_path):
    path = str(tmp_path / "nope.jsonl")
    assert _load_error([path], tokenizer) == f"{path}: file not found; expected an existing .jsonl file"


def test_an_unknown_extension_is_named_with_the_accepted_ones(tokenizer, tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt\nhi\n")
    message = _load_error([str(path)], tokenizer)
    assert message.startswith(f"{path}: unknown extension '.csv'") and ".parquet" in message


def test_a_file_that_is_not_parquet_is_named(tokenizer, tmp_path):
    path = tmp_path / "data.parquet"
    path.write_text('{"prompt": "hi"}\n')
    assert _load_error([str(path)], tokenizer).startswith(f"{path}: cannot read as Parquet")


def test_files_with_no_rows_at_all_are_an_error(tokenizer, write_jsonl):
    path = write_jsonl(["", "   "])
    assert _load_error([path], tokenizer).startswith(f"no rows in ['{path}']")


def test_chat_messages_without_a_chat_template_name_the_row(tokenizer_without_template, write_jsonl):
    path = write_jsonl([GOOD, {"prompt": [{"role": "user", "content": "hi"}]}])
    message = _load_error([path], tokenizer_without_template)
    assert message.startswith(f"{path} line 2: 'prompt' is a list of chat messages but the tokenizer has no chat")


def test_a_single_path_string_is_refused_rather_than_read_letter_by_letter(tokenizer, write_jsonl):
    with pytest.raises(TypeError, match="wrap it in a list"):
        load_prompt_dataset(write_jsonl([GOOD]), tokenizer, max_prompt_tokens=64)


class _CountingTokenizer:
    """Delegates to the real tokenizer and counts the calls that do real work."""

    def __init__(self, inner):
        self.inner = inner
        self.chat_template = inner.chat_template
        self.eos_token_id = inner.eos_token_id
        self.calls = 0

    def __call__(self, text, *, add_special_tokens):
        self.calls += 1
        return self.inner(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, conversation, *, tokenize, add_generation_prompt):
        self.calls += 1
        return self.inner.apply_chat_template(
            conversation, tokenize=tokenize, add_generation_prompt=add_generation_prompt
        )


def test_a_bad_last_row_fails_before_anything_is_rendered_or_tokenized(tokenizer, write_jsonl):
    counting = _CountingTokenizer(tokenizer)
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(50)] + [{"prompt": ""}]
    with pytest.raises(DatasetError, match="line 51"):
        load_prompt_dataset([write_jsonl(rows)], counting, max_prompt_tokens=64)
    assert counting.calls == 0
    load_prompt_dataset([write_jsonl(rows[:-1])], counting, max_prompt_tokens=64)
    assert counting.calls > 0  # the counter does count real loads


def test_a_pretty_printed_json_array_is_recognised(tokenizer, tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[\n  {"prompt": "hi"}\n]\n')
    message = _load_error([str(path)], tokenizer)
    assert message.startswith(f"{path} line 1: malformed JSON") and "looks like one JSON array" in message
