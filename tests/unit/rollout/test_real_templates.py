"""What the models' own chat templates do that a hand-written mirror did not, and the source they come from: templates
that write today's date (Llama 3.2, Mistral Small 3.2) keep appending tool turns after the date changes; Qwen3-Coder's
bare-text arguments are typed by the tool's schema; the templates come from a pinned sdist whose sha256 is checked,
and a wrong file or a failed download fails the tests (never skips them)."""

from __future__ import annotations

import datetime as dt

import pytest

from hybrid_rl.rollout.chat_template import FAMILIES, ToolSuffix
from hybrid_rl.rollout.tool_calls import ToolCall
from tests.unit.rollout import real_templates
from tests.unit.rollout.conftest import CALC
from tests.unit.rollout.templates import FAMILY_OF, tokenizer_for

SCHEMAS = [t.schema for t in CALC]


class _Tomorrow(dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return dt.datetime.now(tz) + dt.timedelta(days=1)


@pytest.mark.parametrize("name", ["llama3.2", "mistral-small-3.2"])
def test_a_template_that_writes_todays_date_still_appends_after_midnight(name, monkeypatch, real_chat_templates):
    """The start-up suffix check renders the base conversation with today's date in its system prompt; a run that
    goes past midnight must still append tool turns (not stop on 'not append-only')."""
    import transformers.utils.chat_template_utils as ctu

    tok = tokenizer_for(name)
    suffix = ToolSuffix(tok, FAMILIES[FAMILY_OF[name]], SCHEMAS)
    message = suffix.tool_message(ToolCall("calc"), "5", 0)
    today = suffix.text([message])
    assert dt.datetime.now().strftime("%Y") in suffix.base_text  # the date is in the template's system prompt
    monkeypatch.setattr(ctu, "datetime", _Tomorrow)
    assert suffix.text([message]) == today  # the tool turn's text has no date in it


def test_the_sdist_is_checked_and_a_wrong_file_fails(tmp_path, monkeypatch):
    wrong = tmp_path / real_templates.SDIST
    wrong.write_bytes(b"not the sdist")
    monkeypatch.setenv("HR_LLAMA_CPP_SDIST", str(wrong))
    with pytest.raises(RuntimeError, match="sha256 .* expected " + real_templates.SHA256):
        real_templates._fetch_sdist(tmp_path)


def test_qwen3_coder_calls_read_back_typed_by_the_tools_schema(calc_runner, real_chat_templates):
    """Qwen3-Coder's template writes every scalar argument as bare text (`123` for the string "123" and for the
    number): the tool's schema says which it is."""
    from hybrid_rl.rollout.tool_calls import get_parser, typed
    from hybrid_rl.rollout.tools.spec import schema_of
    from tests.unit.rollout.tool_fns import echo

    tok = tokenizer_for("qwen3-coder")
    schemas = [schema_of(echo, "echo"), *SCHEMAS]
    calls = [{"type": "function", "function": {"name": "echo", "arguments": {"text": "123"}}},
             {"type": "function", "function": {"name": "calc", "arguments": {"a": 2, "b": 3}}}]
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "", "tool_calls": calls}],
                                       tools=schemas, tokenize=False)
    written = rendered.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    assert "<parameter=text>\n123\n</parameter>" in written  # the string, as the template writes it
    read = [typed(c, schemas) for c in get_parser("qwen3_coder")(written)]
    assert [(c.name, c.arguments) for c in read] == [("echo", {"text": "123"}), ("calc", {"a": 2, "b": 3})]
    # the tool loop reads a model turn so
    from hybrid_rl.rollout.multi_turn import ToolLoop, TurnLimits
    from hybrid_rl.rollout.trajectory import Trajectory
    from hybrid_rl.types import Generation

    loop = ToolLoop(tok, ToolSuffix(tok, FAMILIES["qwen3_coder"], schemas), get_parser("qwen3_coder"), calc_runner,
                    TurnLimits(3, 3, 64, 512))
    ids = tok(written, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    turn_calls, ended = loop.model_turn(Trajectory([1]), Generation(0, ids, [-0.5] * len(ids), "stop"))
    assert ended and [c.arguments for c in turn_calls] == [{"text": "123"}, {"a": 2, "b": 3}]
    # JSON formats say their types themselves: nothing to change
    (hermes,) = get_parser("hermes")('<tool_call>{"name": "echo", "arguments": {"text": 123}}</tool_call>')
    assert typed(hermes, schemas) == hermes


def test_a_failed_download_raises_and_names_the_source(tmp_path, monkeypatch):
    monkeypatch.delenv("HR_LLAMA_CPP_SDIST", raising=False)
    monkeypatch.setattr(real_templates, "URL", "http://127.0.0.1:9/llama_cpp_python.tar.gz")  # nothing listens
    with pytest.raises(RuntimeError, match="could not download http://127.0.0.1:9/.*from PyPI"):
        real_templates._fetch_sdist(tmp_path)
