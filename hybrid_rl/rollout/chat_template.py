"""The ids a chat template adds between turns of a trajectory, without ever re-tokenising the model's own tokens.

A multi-turn trajectory is kept as token ids (`trajectory.py`): the ids the model sampled, then the ids of the
tool messages the template would write after them. Those are found as a *suffix*: the template renders a fixed
conversation (`TemplateFamily.base`: a user turn and a finished assistant turn) with and without the new messages
(plus the generation prompt); the text that the second rendering adds after the first is the suffix. The first
rendering must be an exact prefix of the second: a template that rewrites earlier turns once more messages follow
(one that drops reasoning from assistant turns that are no longer the last, say) would make the trainer see text
the engine never saw, so `TemplateError` stops the run and names the difference.

The boundary rule, per family: the model's turn ends with the family's end-of-turn token (its stop token); the
template then writes `after_turn` (ChatML's newline) before the next message. The model never samples those
boundary ids, so they are context (loss mask 0), as is an end-of-turn token the engine did not produce (a turn cut
by the length limit). `ToolSuffix` checks the rule against the tokenizer's own template once, at start-up, and
renders a probe tool exchange through it there: a template that refuses the tool messages the loop will write (one
that needs a `tool_call_id` in its own format, say) stops the run before step 1, naming the family.

Tool messages carry a `tool_call_id`: the id the model wrote in its call when the family's format has one and it is
valid, else a deterministic one from the call's position in the trajectory (`TemplateFamily.call_id`), so the same
trajectory always renders to the same ids.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_rl.rollout.tool_calls import ToolCall

Message = Mapping[str, Any]


class TemplateError(ValueError):
    """The chat template cannot be extended append-only (or does not follow its family's boundary rule)."""


@dataclass(frozen=True)
class TemplateFamily:
    """How one family of chat templates ends an assistant turn, and how its models write tool calls."""

    name: str
    end_of_turn: str  # the token that ends an assistant turn (the engine's stop token)
    after_turn: str  # text the template writes after it, before the next message: boundary tokens, mask 0
    parser: str  # the tool-call parser (`tool_calls.PARSERS`)
    # The fixed conversation the suffix is rendered after: it must end with a finished assistant turn whose
    # rendering stays the same when messages follow (Qwen3 keeps an assistant turn's reasoning only while it is
    # the last one, unless it has reasoning of its own: hence the reasoning_content here).
    base: tuple[Message, ...] = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"})
    # Tool call ids: `call_id_format` with the call's position in the trajectory; a model's own id is kept when it
    # matches `call_id_pattern` (Mistral's: 9 alphanumeric characters, which its template requires).
    call_id_format: str = "call_{k}"
    call_id_pattern: str = r"[A-Za-z0-9_\-]+"
    # The model's reasoning block (Qwen3's <think>...</think>): calls written inside it are thoughts, not calls.
    reasoning: tuple[str, str] | None = None

    def call_id(self, call: ToolCall, k: int) -> str:
        """The `tool_call_id` of the trajectory's `k`-th call (0-based)."""
        if call.id and re.fullmatch(self.call_id_pattern, call.id):
            return call.id
        return self.call_id_format.format(k=k)

    def answer_text(self, text: str) -> str:
        """The part of a model turn its tool calls are parsed from: after the reasoning block (nothing while the
        block is still open: a turn cut mid-thought)."""
        if self.reasoning is None:
            return text
        start, end = self.reasoning
        if end in text:
            return text.rsplit(end, 1)[1]
        return "" if start in text else text


QWEN3_BASE = ({"role": "user", "content": "hi"},
              {"role": "assistant", "content": "ok", "reasoning_content": "ok"})

# rollout.multi_turn.template -> family. "chatml" covers Qwen2 / Qwen2.5 and SmolLM2 (<|im_start|> ... <|im_end|>\n).
FAMILIES: dict[str, TemplateFamily] = {
    "chatml": TemplateFamily("chatml", "<|im_end|>", "\n", "hermes"),
    "qwen3": TemplateFamily("qwen3", "<|im_end|>", "\n", "hermes", QWEN3_BASE, reasoning=("<think>", "</think>")),
    "llama3": TemplateFamily("llama3", "<|eot_id|>", "", "llama3_json"),
    "mistral": TemplateFamily("mistral", "</s>", "", "mistral", call_id_format="call{k:05d}",
                              call_id_pattern=r"[A-Za-z0-9]{9}"),
    # Mistral's tokenizer v11+ templates: calls as [TOOL_CALLS]name[ARGS]{...}
    "mistral_args": TemplateFamily("mistral_args", "</s>", "", "mistral_args", call_id_format="call{k:05d}",
                                   call_id_pattern=r"[A-Za-z0-9]{9}"),
    # Qwen3-Coder: ChatML, calls as XML (<function=name><parameter=key>value</parameter></function>)
    "qwen3_coder": TemplateFamily("qwen3_coder", "<|im_end|>", "\n", "qwen3_coder"),
    # Llama 4: <|header_start|> ... <|eot|>, pythonic calls
    "llama4": TemplateFamily("llama4", "<|eot|>", "", "pythonic"),
}


def detect_family(chat_template: str | None) -> TemplateFamily:
    """The family of a chat template, from the markers it writes (the order matters: Qwen3 is ChatML + <think>)."""
    t = chat_template or ""
    if "<|im_start|>" in t:
        if "<function=" in t:
            return FAMILIES["qwen3_coder"]
        return FAMILIES["qwen3" if "<think>" in t else "chatml"]
    if "<|header_start|>" in t:
        return FAMILIES["llama4"]
    if "<|start_header_id|>" in t:
        return FAMILIES["llama3"]
    if "[INST]" in t:
        return FAMILIES["mistral_args" if "[ARGS]" in t else "mistral"]
    raise TemplateError("cannot tell the chat template's family (no <|im_start|>, <|header_start|>, "
                        "<|start_header_id|> or [INST] in it); set rollout.multi_turn.template to one of "
                        f"{sorted(FAMILIES)}")


def family_of(name: str, chat_template: str | None) -> TemplateFamily:
    if name == "auto":
        return detect_family(chat_template)
    if name not in FAMILIES:
        raise TemplateError(f"rollout.multi_turn.template={name!r}: expected auto or one of {sorted(FAMILIES)}")
    return FAMILIES[name]


class ToolSuffix:
    """The context ids appended after a model turn: boundary tokens, then the rendered tool messages and the next
    generation prompt. Built once per run (it renders and checks the base conversation)."""

    def __init__(self, tokenizer, family: TemplateFamily, tools: Sequence[dict] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None, *, user_turns: bool = False):
        self.tokenizer, self.family, self.tools = tokenizer, family, list(tools) if tools else None
        self.template_kwargs = dict(template_kwargs or {})  # e.g. Qwen3's enable_thinking
        self.base_text = self._render(family.base, generation_prompt=False)
        eot = family.end_of_turn + family.after_turn
        if not self.base_text.endswith(eot):
            tail = self.base_text[-40:]
            raise TemplateError(f"the chat template does not end an assistant turn with {eot!r} as the {family.name} "
                                f"family does (it ends with {tail!r}); set rollout.multi_turn.template to its family")
        self.end_of_turn_id = self._single_id(family.end_of_turn)
        self.boundary_ids = self._encode(family.after_turn)
        self.text([self.tool_message(ToolCall("probe"), "ok", 0)])  # the tool exchange the loop will render
        if user_turns:  # an environment's user simulator: a user message after a model turn must append too
            try:
                self.text([{"role": "user", "content": "ok"}])
            except TemplateError as e:
                raise TemplateError(f"the environment answers as the user (respond), but {e}") from None

    def tool_message(self, call: ToolCall, content: str, k: int) -> dict[str, Any]:
        """The tool message answering `call`, the trajectory's `k`-th call (0-based)."""
        return {"role": "tool", "name": call.name or "invalid", "content": content,
                "tool_call_id": self.family.call_id(call, k)}

    def _single_id(self, token: str) -> int:
        ids = self._encode(token)
        if len(ids) != 1:
            raise TemplateError(f"the end-of-turn marker {token!r} is {len(ids)} tokens for this tokenizer, expected "
                                "one special token")
        return ids[0]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt, **self.template_kwargs)
        except Exception as e:  # jinja's own errors (raise_exception in the template) are no ValueError
            roles = "/".join(str(m.get("role")) for m in messages)
            raise TemplateError(f"the {self.family.name} chat template fails on a tool exchange ({roles}): "
                                f"{type(e).__name__}: {e}") from e

    def text(self, messages: Sequence[Message]) -> str:
        """The text the template adds after a finished assistant turn for `messages` and the next generation prompt.

        The base rendered at start-up is rendered again where the full text no longer starts with it: templates that
        write today's date (Llama 3.2's, Mistral Small 3.2's) render it differently once the date changes, and a run
        goes on past midnight. A second try covers the date changing between the two renderings."""
        base = self.base_text
        for _ in range(2):
            full = self._render([*self.family.base, *messages], generation_prompt=True)
            if full.startswith(base):
                return full[len(base):]
            base = self.base_text = self._render(self.family.base, generation_prompt=False)
            if full.startswith(base):
                return full[len(base):]
        at = next((i for i, (a, b) in enumerate(zip(base, full, strict=False)) if a != b), len(full))
        raise TemplateError(
            "the chat template is not append-only: adding messages after a model turn changes the earlier turns' text at char "
            f"{at} ({base[at:at + 40]!r} becomes {full[at:at + 40]!r}), so the trainer would see text the engine "
            "never saw. Use a template that renders earlier turns the same whatever follows.")

    def ids(self, messages: Sequence[Message], *, ended: bool) -> list[int]:
        """Context ids after a model turn: its end-of-turn token when the engine did not produce it (`ended`: the
        turn stopped on it), the family's boundary tokens, then the suffix for `messages`."""
        head = [] if ended else [self.end_of_turn_id]
        return head + self.boundary_ids + self._encode(self.text(messages))


RAW_PROMPTS_WITH_TOOLS = (
    "rollout.tools is set but the dataset's prompts are plain strings, which reach the model as they are: without "
    "the chat template, so without the tools' schemas and the format to call them in. Set "
    "data.apply_chat_template=true (each prompt becomes one user message) or give the prompts as lists of chat "
    "messages.")


class _WithTools:
    """A tokenizer whose chat template always gets the tools (`with_tools`); everything else is the tokenizer's."""

    def __init__(self, tokenizer, tools: list[dict], raw_prompts: bool):
        self._tokenizer, self._tools, self._raw_prompts = tokenizer, tools, raw_prompts

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        # the data layer tokenizes raw (untemplated) prompt text, and only that, with the tokenizer's special tokens
        if kwargs.get("add_special_tokens", True) and not self._raw_prompts:
            raise TemplateError(RAW_PROMPTS_WITH_TOOLS)
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, conversation, **kwargs):
        return self._tokenizer.apply_chat_template(conversation, tools=self._tools, **kwargs)


def with_tools(tokenizer, tools: list[dict], *, raw_prompts: bool = False):
    """`tokenizer`, rendering every chat prompt with `tools=` (the data layer renders the prompts; it need not know
    about tools). Plain-string prompts, which no template renders, are refused with one clear error unless
    `raw_prompts` (an environment whose `reset` returns the prompts)."""
    return _WithTools(tokenizer, tools, raw_prompts)
