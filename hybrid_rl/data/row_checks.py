"""Check the content of one row (prompt, chat messages, responses, required keys) before any tokenization.

Every check raises `DatasetError` naming the row's file and line, what is wrong and what is expected; it
returns the value in the one shape the encoder accepts. A key holding `null` counts as missing, as Parquet
writes a null for a column that a row lacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybrid_rl.data.rows import RowLocation, SourceRow

Messages = list[dict[str, Any]]
PROMPT_SHAPE = "a non-empty string, or a non-empty list of {'role': str, 'content': str} chat messages"


def check_required_keys(row: SourceRow, keys: Sequence[str]) -> None:
    """Raise if one of `keys` is absent or null."""
    for key in keys:
        if row.data.get(key) is None:
            raise row.where.error(f"missing required key {key!r} (the row has {sorted(row.data)})", f"a {key!r} value")


def check_prompt(row: SourceRow, key: str, *, has_chat_template: bool) -> str | Messages:
    """Return the row's prompt: a non-blank string, or a list of well-formed chat messages."""
    value = row.data.get(key)
    where = row.where
    if value is None:
        raise where.error(f"missing {key!r} (the row has {sorted(row.data)})", PROMPT_SHAPE)
    if isinstance(value, str):
        if not value.strip():
            raise where.error(f"{key!r} is empty or only whitespace", PROMPT_SHAPE)
        return value
    if not isinstance(value, list):
        raise where.error(f"{key!r} is a {type(value).__name__}", PROMPT_SHAPE)
    messages = check_messages(value, where, key)
    if not has_chat_template:
        raise where.error(
            f"{key!r} is a list of chat messages but the tokenizer has no chat template",
            "a tokenizer with `chat_template` set, or plain-string prompts",
        )
    return messages


def check_messages(value: list[Any], where: RowLocation, key: str) -> Messages:
    """Return `value` if it is a non-empty list of {role, content} string messages with some non-blank content."""
    if not value:
        raise where.error(f"{key!r} is an empty list", PROMPT_SHAPE)
    for i, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and message["role"]
            and isinstance(message.get("content"), str)
        ):
            raise where.error(f"{key}[{i}] is {_short(message)}", "a {'role': str, 'content': str} object")
    if all(not message["content"].strip() for message in value):
        raise where.error(f"every message in {key!r} has empty content", PROMPT_SHAPE)
    return value


def check_response(row: SourceRow, key: str, prompt: str | Messages, *, chat: bool) -> str:
    """Return the text of a DPO response: a plain string, or the content of a conversation's last message.

    A conversation (list of messages) must end with the assistant reply; any messages before it must repeat
    the prompt (a string prompt reads as one user message), which is how UltraFeedback-style files store pairs.
    Only the reply is used: the prompt is always taken from the prompt column. A conversation is refused when
    the prompt is not rendered with the chat template (`chat=False`), as the two halves would not match.
    """
    value = row.data.get(key)
    where = row.where
    shape = "a non-empty string, or a list of chat messages ending with the assistant reply"
    if value is None:
        raise where.error(f"missing {key!r} (the row has {sorted(row.data)})", shape)
    if isinstance(value, str):
        if not value.strip():
            raise where.error(f"{key!r} is empty or only whitespace", shape)
        return value
    if not isinstance(value, list):
        raise where.error(f"{key!r} is a {type(value).__name__}", shape)
    messages = check_messages(value, where, key)
    if not chat:
        raise where.error(
            f"{key!r} is a chat conversation but the prompt is a plain string rendered without a chat template",
            "apply_chat_template=True, or plain-string responses",
        )
    reply, before = messages[-1], messages[:-1]
    if reply["role"] != "assistant" or not reply["content"].strip():
        raise where.error(f"the last message of {key!r} is {_short(reply)}", "a non-empty assistant message")
    prompt_messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if before and _turns(before) != _turns(prompt_messages):
        raise where.error(
            f"the messages of {key!r} before its reply differ from the prompt",
            "the same messages as the prompt, or the assistant reply alone",
        )
    return reply["content"]


def _turns(messages: Messages) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
