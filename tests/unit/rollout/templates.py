"""Small chat templates mirroring the tool handling of each supported family's real template, and tokenizers for
them built offline from the tiny test tokenizer (`hybrid_rl.model.tiny`)."""

from __future__ import annotations

import copy
import functools

_TOOLS_BLOCK = ("{%- if tools %}{{ '<|im_start|>system\\nYou may call tools.\\n<tools>' }}{%- for t in tools %}"
                "{{ '\\n' + (t | tojson) }}{%- endfor %}{{ '\\n</tools><|im_end|>\\n' }}{%- endif %}")

# Qwen2.5: tool results go back as a user turn of <tool_response> blocks, consecutive ones grouped.
QWEN25 = _TOOLS_BLOCK + (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")

# SmolLM2: plain ChatML with a default system prompt; a tool message is a turn of role "tool".
SMOLLM2 = (
    "{%- if messages[0].role != 'system' %}{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")

# Qwen3: as Qwen2.5, but the reasoning is taken out of an assistant turn's content, and shown again only for turns
# after the last user message, while the turn is the last message or when given as reasoning_content.
QWEN3 = _TOOLS_BLOCK + (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'assistant' %}{%- set r = m.reasoning_content | default('') %}{%- set c = m.content %}"
    "{%- if '</think>' in c %}{%- set r = c.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and (loop.last or r) %}{{ '<think>\\n' + r + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{ c + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")

# Llama 3.1: headers, <|eot_id|>; tool results as the "ipython" role.
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}"
    "{%- if tools %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\nTools:' }}{%- for t in tools %}"
    "{{ ' ' + (t | tojson) }}{%- endfor %}{{ '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}{%- set role = 'ipython' if m.role == 'tool' else m.role %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

# Mistral (v3 tokenizer): [INST] ... [/INST], the tools before the last user message, the assistant's turn ends with
# </s>, tool results in [TOOL_RESULTS] with their call's id, which must be 9 alphanumeric characters (the real
# template raises otherwise).
MISTRAL = (
    "{{ '<s>' }}{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{%- if tools and m == users | last %}{{ '[AVAILABLE_TOOLS] ' + (tools | tojson) + "
    "'[/AVAILABLE_TOOLS]' }}{%- endif %}{{ '[INST] ' + m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' %}{{ m.content + '</s>' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if m.tool_call_id is not defined or m.tool_call_id | length != 9 or not m.tool_call_id.isalnum() %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{ '[TOOL_RESULTS] ' + ({'content': m.content, 'call_id': m.tool_call_id} | tojson) + '[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}")

# A template that is not append-only: the system line changes once a tool has answered.
REWRITES = (
    "{%- set used = messages | selectattr('role', 'equalto', 'tool') | list | length > 0 %}"
    "{{ '<|im_start|>system\\n' + ('Tools were used.' if used else 'No tools yet.') + '<|im_end|>\\n' }}"
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")

TEMPLATES = {"qwen2.5": QWEN25, "smollm2": SMOLLM2, "qwen3": QWEN3, "llama3": LLAMA3, "mistral": MISTRAL,
             "rewrites": REWRITES}
# name -> (family, its end-of-turn token, the tool-call text the model writes for calc(a=2, b=3))
FAMILY_OF = {"qwen2.5": "chatml", "smollm2": "chatml", "qwen3": "qwen3", "llama3": "llama3", "mistral": "mistral"}
CALL_TEXT = {
    "chatml": '<tool_call>\n{"name": "calc", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "qwen3": '<think>\nadd them\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "llama3": '{"name": "calc", "parameters": {"a": 2, "b": 3}}',
    "mistral": '[TOOL_CALLS] [{"name": "calc", "arguments": {"a": 2, "b": 3}}]',
}
_EXTRA = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "[INST]",
          "[/INST]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]"]


@functools.lru_cache(maxsize=1)
def _base():
    from hybrid_rl.model.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": _EXTRA})
    return tok


def tokenizer_for(name: str):
    tok = copy.deepcopy(_base())
    tok.chat_template = TEMPLATES[name]
    return tok


def calc(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b
