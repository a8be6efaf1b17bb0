"""The chat endpoint's OpenAI contract over HTTP, the server scripted (its ids chosen by the test): a user follow-up
is rendered whole (a new trajectory) where the template rewrites earlier turns, not refused; a chat template's own
error is a 400; `stop` cuts the reply and its recorded ids; `chat_template_kwargs` reach the template; tool calls
come back parsed, in the OpenAI format, and out of `content` where the format says so."""

from __future__ import annotations

import json

import pytest
import requests

from hybrid_rl.rollout.chat_template import FAMILIES
from hybrid_rl.rollout.tool_calls import get_parser
from hybrid_rl.sidecar.chat_endpoint import ChatEndpoint
from hybrid_rl.sidecar.completions import Router
from hybrid_rl.types import Generation, Sampling
from tests.unit.rollout.templates import call_text, tokenizer_for

TOOL = {"type": "function", "function": {"name": "calc", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


class ScriptedServer:
    """Answers the k-th request with `replies[k]` (text, then the end-of-turn token unless it ends with '|cut');
    records the prompts."""

    def __init__(self, tok, eot: str, replies: list[str]):
        self.tok, self.eot, self.replies, self.prompts = tok, tok.convert_tokens_to_ids(eot), replies, []

    def run(self, reqs, sampling, router, model):
        out = {}
        for r in reqs:
            text = self.replies[len(self.prompts)]
            self.prompts.append(list(r.prompt))
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.eot]
            out[r.key] = Generation(0, ids, [-0.5] * len(ids), "stop")
        return out, {}


@pytest.fixture
def endpoint_for(real_chat_templates):
    made = []

    def make(name, family, eot, replies):
        tok = tokenizer_for(name)
        server = ScriptedServer(tok, eot, replies)
        ep = ChatEndpoint(server, tok, FAMILIES[family])
        made.append(ep)
        url = ep.open("e", sampling=Sampling(max_tokens=64), router=Router())
        return ep, server, tok, url

    yield make
    for ep in made:
        ep.shutdown()


def _post(url, **body):
    return requests.post(f"{url}/chat/completions", json={"model": "policy", **body}, timeout=30)


@pytest.mark.parametrize(("name", "family", "eot"), [("qwen3", "qwen3", "<|im_end|>"),
                                                     ("mistral-nemo", "mistral", "</s>"),
                                                     ("mistral-small-3.2", "mistral_args", "</s>"),
                                                     ("mistral-v3", "mistral", "</s>")])
def test_a_user_follow_up_is_rendered_whole_not_refused(endpoint_for, name, family, eot):
    ep, server, tok, url = endpoint_for(name, family, eot, ["first answer", "second answer"])
    messages = [{"role": "user", "content": "hi"}]
    first = _post(url, messages=messages, tools=[TOOL])
    assert first.status_code == 200, first.text
    messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "and again?"}]
    second = _post(url, messages=messages, tools=[TOOL])
    assert second.status_code == 200, second.text
    rendered = tok.apply_chat_template(messages, tools=[TOOL], tokenize=False, add_generation_prompt=True)
    assert server.prompts[1] == tok(rendered, add_special_tokens=False)["input_ids"]
    assert len(ep.close("e")) == 2


def test_an_error_raised_by_the_chat_template_is_a_400(endpoint_for):
    _, _, _, url = endpoint_for("mistral-nemo", "mistral", "</s>", ["x"])
    r = _post(url, messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                             {"role": "tool", "content": "5"}])  # no tool_call_id: the template raises
    assert r.status_code == 400 and "Tool call IDs" in r.json()["error"]["message"]


def test_stop_cuts_the_reply_and_its_recorded_ids(endpoint_for):
    ep, _, tok, url = endpoint_for("qwen2.5", "chatml", "<|im_end|>", ["alpha beta STOP gamma delta"])
    r = _post(url, messages=[{"role": "user", "content": "hi"}], stop=["STOP"])
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "alpha beta " and choice["finish_reason"] == "stop"
    (call,) = ep.close("e")
    kept = tok.decode(call.output_ids)
    assert "STOP" in kept and "gamma" not in kept and len(call.logprobs) == len(call.output_ids)


def test_chat_template_kwargs_reach_the_template(endpoint_for):
    ep, server, tok, url = endpoint_for("qwen3", "qwen3", "<|im_end|>", ["4"])
    # the generation prompt of a non-thinking turn, as Qwen3's own template writes it
    r = _post(url, messages=[{"role": "user", "content": "2+2?"}], chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text
    assert tok.decode(server.prompts[0]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize(("name", "family", "eot"), [
    ("qwen2.5", "chatml", "<|im_end|>"), ("qwen3", "qwen3", "<|im_end|>"), ("mistral-nemo", "mistral", "</s>"),
    ("mistral-v3", "mistral", "</s>"), ("llama3.1", "llama3", "<|eot_id|>"), ("llama3.2", "llama3", "<|eot_id|>"),
    ("qwen3-coder", "qwen3_coder", "<|im_end|>"), ("llama4-mirror", "llama4", "<|eot|>"),
    ("mistral-small-3.2", "mistral_args", "</s>"), ("devstral", "mistral_args", "</s>"),
    ("mistral-v13", "mistral_args", "</s>")])
def test_tool_calls_come_back_parsed_in_the_openai_format(endpoint_for, name, family, eot):
    prose = family in ("chatml", "qwen3_coder")  # formats where text may come before the calls
    ep, _, _, url = endpoint_for(name, family, eot, ["Let me add. " * prose + call_text(name)])
    r = _post(url, messages=[{"role": "user", "content": "2+3?"}], tools=[TOOL])
    choice = r.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "calc"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    (parsed,) = get_parser(FAMILIES[family].parser)(FAMILIES[family].answer_text(call_text(name)))
    assert call["id"] == FAMILIES[family].call_id(parsed, 0) and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == ("Let me add." if prose else "<think>\nadd them\n</think>"
                                            if family == "qwen3" else "")


def test_a_qwen3_coder_string_argument_comes_back_a_string(endpoint_for):
    """The XML format writes the string "123" as bare 123; the request's tool schema says it is a string."""
    echo = {"type": "function", "function": {"name": "echo", "description": "Echo.", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}}}}
    reply = "<tool_call>\n<function=echo>\n<parameter=text>\n123\n</parameter>\n</function>\n</tool_call>"
    _, _, _, url = endpoint_for("qwen3-coder", "qwen3_coder", "<|im_end|>", [reply])
    r = _post(url, messages=[{"role": "user", "content": "say 123"}], tools=[echo, TOOL])
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"text": "123"}
