"""Load prompt datasets (RL) and preference datasets (DPO) from JSON Lines or Parquet files.

Loading runs in three passes, so that a bad row fails in a second, not after tokenizing everything:
1. read every row (`rows.py`) and check every row (`row_checks.py`): nothing is tokenized yet;
2. render prompts (chat template) and tokenize, in batches;
3. drop rows over the token limits, count them and log one warning. Prompts are never truncated: a cut
   prompt loses the question or the answer format, and the reward would then score noise.

Prompt rendering:
- a list of chat messages goes through `tokenizer.apply_chat_template(..., add_generation_prompt=True)` and
  is tokenized without special tokens (the template writes them);
- a plain string is tokenized as it is, with the tokenizer's own special tokens (BOS for Llama, none for
  Qwen), as vLLM does for a text prompt. Pass `apply_chat_template=True` to wrap it as one user message and
  render it like a list instead; it is off by default because base-model datasets (and prompts already
  formatted by hand) must reach the model unchanged.

Responses (DPO) are tokenized on their own, without special tokens, and end with `eos_token_id`, which is
what the policy emits at rollout. Their length limit counts that eos.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from hybrid_rl.data.records import PreferenceDataset, PreferenceRecord, PromptDataset, PromptRecord, ReadOnlyFields
from hybrid_rl.data.row_checks import Messages, check_prompt, check_required_keys, check_response
from hybrid_rl.data.rows import DatasetError, RowLocation, read_rows

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """What the loaders use of a Hugging Face tokenizer (`PreTrainedTokenizerFast` satisfies it)."""

    chat_template: str | None
    eos_token_id: int | None

    def __call__(self, text: list[str], *, add_special_tokens: bool) -> Mapping[str, Any]: ...

    def apply_chat_template(self, conversation: Messages, *, tokenize: bool, add_generation_prompt: bool) -> str: ...


def load_prompt_dataset(
    files: Sequence[str],
    tokenizer: Tokenizer,
    *,
    max_prompt_tokens: int,
    prompt_key: str = "prompt",
    required_keys: Sequence[str] = (),
    apply_chat_template: bool = False,
) -> PromptDataset:
    """Read prompts and their reward fields; drop (and count) prompts longer than `max_prompt_tokens`.

    Args:
        files: `.jsonl`/`.json` (JSON Lines) or `.parquet` paths, read in order.
        tokenizer: a Hugging Face tokenizer (see `Tokenizer`).
        max_prompt_tokens: longest prompt kept, in tokens after rendering.
        prompt_key: the column holding the prompt (a string or a list of {role, content} messages).
        required_keys: columns every row must have (non-null), e.g. `("ground_truth",)` for a math reward.
        apply_chat_template: also render plain-string prompts with the chat template (as one user message).

    Raises:
        DatasetError: a file or row is malformed (the message names the file and line), or no prompt fits.
    """
    _check_limit("max_prompt_tokens", max_prompt_tokens)
    has_template = _has_chat_template(tokenizer, apply_chat_template)
    rows = read_rows(files)
    prompts = []
    for row in rows:
        prompts.append(check_prompt(row, prompt_key, has_chat_template=has_template))
        check_required_keys(row, required_keys)

    texts, prompt_ids = _encode_prompts(tokenizer, prompts, [row.where for row in rows], apply_chat_template)
    records = tuple(
        PromptRecord(
            index=i,
            prompt_text=texts[i],
            prompt_ids=tuple(prompt_ids[i]),
            fields=ReadOnlyFields({k: v for k, v in row.data.items() if k != prompt_key}),
        )
        for i, row in enumerate(rows)
        if len(prompt_ids[i]) <= max_prompt_tokens
    )
    _report_dropped(len(rows), len(records), files, f"max_prompt_tokens={max_prompt_tokens}")
    return PromptDataset(records, num_dropped_too_long=len(rows) - len(records), max_prompt_tokens=max_prompt_tokens)


def load_preference_dataset(
    files: Sequence[str],
    tokenizer: Tokenizer,
    *,
    max_prompt_tokens: int,
    max_response_tokens: int,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    apply_chat_template: bool = False,
) -> PreferenceDataset:
    """Read DPO pairs; drop (and count) pairs whose prompt or either response is over its limit.

    `chosen`/`rejected` are strings (the reply text), or conversations ending with the assistant reply
    (see `row_checks.check_response`). Other arguments and errors are as in `load_prompt_dataset`.
    """
    _check_limit("max_prompt_tokens", max_prompt_tokens)
    _check_limit("max_response_tokens", max_response_tokens)
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id; DPO responses must end with eos")
    has_template = _has_chat_template(tokenizer, apply_chat_template)
    rows = read_rows(files)
    prompts, chosen, rejected = [], [], []
    for row in rows:
        prompt = check_prompt(row, prompt_key, has_chat_template=has_template)
        chat = isinstance(prompt, list) or apply_chat_template
        prompts.append(prompt)
        chosen.append(check_response(row, chosen_key, prompt, chat=chat))
        rejected.append(check_response(row, rejected_key, prompt, chat=chat))

    _, prompt_ids = _encode_prompts(tokenizer, prompts, [row.where for row in rows], apply_chat_template)
    eos = (tokenizer.eos_token_id,)
    chosen_ids = [tuple(ids) + eos for ids in _tokenize(tokenizer, chosen, add_special_tokens=False)]
    rejected_ids = [tuple(ids) + eos for ids in _tokenize(tokenizer, rejected, add_special_tokens=False)]
    records = tuple(
        PreferenceRecord(
            index=i, prompt_ids=tuple(prompt_ids[i]), chosen_ids=chosen_ids[i], rejected_ids=rejected_ids[i]
        )
        for i in range(len(rows))
        if len(prompt_ids[i]) <= max_prompt_tokens
        and max(len(chosen_ids[i]), len(rejected_ids[i])) <= max_response_tokens
    )
    limits = f"max_prompt_tokens={max_prompt_tokens} or max_response_tokens={max_response_tokens}"
    _report_dropped(len(rows), len(records), files, limits)
    return PreferenceDataset(
        records,
        num_dropped_too_long=len(rows) - len(records),
        max_prompt_tokens=max_prompt_tokens,
        max_response_tokens=max_response_tokens,
    )


def _check_limit(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be a positive number of tokens, got {value}")


def _has_chat_template(tokenizer: Tokenizer, apply_chat_template: bool) -> bool:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if apply_chat_template and not has_template:
        raise ValueError("apply_chat_template=True but the tokenizer has no chat template; set one or pass False")
    return has_template


def _encode_prompts(
    tokenizer: Tokenizer, prompts: list[str | Messages], wheres: list[RowLocation], apply_chat_template: bool
) -> tuple[list[str], list[list[int]]]:
    """Render every prompt to text, then tokenize templated and raw texts in one batch each."""
    texts: list[str] = []
    templated: list[bool] = []
    for prompt, where in zip(prompts, wheres, strict=True):
        if isinstance(prompt, str) and not apply_chat_template:
            texts.append(prompt)
            templated.append(False)
            continue
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        try:
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        except Exception as e:  # the template is user code (jinja `raise_exception`): say which row broke it
            raise where.error(f"the chat template failed ({type(e).__name__}: {e})", "messages it accepts") from e
        templated.append(True)

    ids: list[list[int]] = [[] for _ in texts]
    for with_template in (True, False):
        positions = [i for i, t in enumerate(templated) if t == with_template]
        encoded = _tokenize(tokenizer, [texts[i] for i in positions], add_special_tokens=not with_template)
        for i, row_ids in zip(positions, encoded, strict=True):
            ids[i] = row_ids
    return texts, ids


def _tokenize(tokenizer: Tokenizer, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
    if not texts:
        return []
    return list(tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"])


def _report_dropped(num_rows: int, num_kept: int, files: Sequence[str], limits: str) -> None:
    num_dropped = num_rows - num_kept
    if num_kept == 0:
        raise DatasetError(f"all {num_rows} rows of {list(files)} exceed {limits}; expected some rows within it")
    if num_dropped:
        logger.warning(
            "dropped %d of %d rows over %s (never truncated) from %s", num_dropped, num_rows, limits, list(files)
        )
