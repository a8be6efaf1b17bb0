"""What the models' own chat templates do that a hand-written mirror did not, and the source they come from: templates
that write today's date (Llama 3.2, Mistral Small 3.2) keep appending tool turns after the date changes; the real
templates are fetched from a pinned, checked sdist, and a wrong file fails loudly."""

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
def test_a_template_that_writes_todays_date_still_appends_after_midnight(name, monkeypatch):
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
