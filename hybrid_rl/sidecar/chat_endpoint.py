"""An OpenAI-compatible chat endpoint in front of the sidecar servers, recording every call as token ids (issue 24
item 5: black-box agents).

An agent written against the OpenAI client is given `base_url = ChatEndpoint.open(episode)` and calls
`POST {base_url}/chat/completions` (non-streaming) as it would any server. The endpoint turns the messages into token
ids, sends them to a vLLM server's token-in/token-out `/inference/v1/generate` (the sidecar's own path, so the ids
recorded are the ids the server saw and sampled, with the sampler's log-probs), answers in the OpenAI format and
records a `stitch.RecordedCall` (with the policy version of each sampled id, from the server's weight-version spans:
asynchronous training sees the agent's tokens' ages as it sees the tool loop's); `close(episode)` hands the calls to
`stitch.stitch`.

No re-tokenisation drift across calls: when a call's messages extend the previous call's (the same messages, then
the previous reply as the assistant's message, then new ones), its prompt is the previous call's recorded ids, the
ids the server sampled, and the new messages alone tokenised as the chat template's suffix after an assistant turn
(`chat_template.ToolSuffix`, which checks the template is append-only). Any other call is rendered whole; the
stitch rule then decides whether it still extends the trajectory or starts a new sample.

New messages that the template cannot append without rewriting earlier turns (a user follow-up, for templates that
move the tools or drop earlier reasoning once a user speaks: Qwen3's, Mistral's) are rendered whole. An error the
chat template raises is the request's (400).

The answer follows the OpenAI format: `stop` strings end the reply (the recorded ids end with the one that completed
the stop string), `chat_template_kwargs` reach the template (Qwen3's `enable_thinking`), and tool calls the family's
format reads in the reply come back parsed as `tool_calls` (ids in the family's format), `content` then holding the
text without them, with `finish_reason` "tool_calls".

Limits (the README's black-box section): sampling is the run's (`rollout.temperature`...; the request's
temperature/top_p are ignored, the request's `max_tokens` only lowers the budget), one choice per call, no streaming.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hybrid_rl.rollout.chat_template import TemplateError, TemplateFamily, ToolSuffix
from hybrid_rl.rollout.tool_calls import get_format, typed
from hybrid_rl.sidecar.completions import CompletionClient, Router
from hybrid_rl.sidecar.stitch import RecordedCall
from hybrid_rl.sidecar.vllm_server import SERVED_MODEL
from hybrid_rl.types import Generation, Request, Sampling

log = logging.getLogger(__name__)
_CALL_SEED_STRIDE = 7919  # a call's seed: the episode's + its index times this (each call samples afresh)


@dataclass
class _Episode:
    seed: int
    sampling: Sampling
    router: Router
    calls: list[RecordedCall] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the last call's messages and its reply's text
    reply: str = ""
    ended: bool = False  # the last call stopped on the end-of-turn token (it is then in its output ids)
    tool_calls: int = 0  # the calls answered so far (each tool call's id is its position in the episode)
    lock: threading.Lock = field(default_factory=threading.Lock)  # an episode's calls are made one after another


MAX_BODY_BYTES = 8 * 2**20  # one call's JSON (the conversation so far, tools): a larger body is refused (413)


class ChatEndpoint:
    """`/episodes/<id>/v1/chat/completions` on a local port, each episode's calls recorded as token ids."""

    def __init__(self, client: CompletionClient, tokenizer, family: TemplateFamily, *, host: str = "127.0.0.1",
                 port: int = 0, model: Callable[[], str] = lambda: SERVED_MODEL,
                 versions: Callable[[Generation], Sequence[int]] = lambda g: ()):
        self.client = client
        # The policy version of each sampled id, from the server's spans (`SidecarRollout.versions_of`); () records
        # none. Raising (a version the run never pushed) fails the call.
        self.versions = versions
        # What each call names as its model, read per call: the served base, or with `model.lora.sync=adapter` the
        # adapter version the servers were last brought to (`SidecarRollout.model_name`), as every other request.
        self.model = model
        self.tokenizer, self.family = tokenizer, family
        self.format = get_format(family.parser)
        self._suffixes: dict[str, ToolSuffix] = {}
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()
        self._keys = iter(range(1 << 62))  # request keys: the router keeps each on its episode's server
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True, name="chat-endpoint")
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def open(self, episode: str, *, sampling: Sampling, router: Router, seed: int = 0) -> str:
        """Start recording `episode` (its calls sampled with `sampling` on the server `router` picks for it); the
        base URL its agent is given (OpenAI's `base_url`)."""
        with self._lock:
            if episode in self._episodes:
                raise ValueError(f"episode {episode!r} is already open")
            self._episodes[episode] = _Episode(seed, sampling, router)
        return f"{self.url}/episodes/{episode}/v1"

    def close(self, episode: str) -> list[RecordedCall]:
        """Stop recording `episode`: its calls in the order they were made."""
        with self._lock:
            return self._episodes.pop(episode).calls

    def shutdown(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    # -- one call --------------------------------------------------------------------------------

    def complete(self, episode: str, body: dict) -> dict:
        """One `/chat/completions` request of `episode` -> the OpenAI answer; the call is recorded."""
        with self._lock:
            ep = self._episodes.get(episode)
        if ep is None:
            raise KeyError(f"no open episode {episode!r}")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        if body.get("stream"):
            raise ValueError("streaming is not supported: call with stream=False")
        if int(body.get("n", 1)) != 1:
            raise ValueError("n must be 1 (one recorded sample per call)")
        tools = body.get("tools") or None
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ValueError("'chat_template_kwargs' must be an object")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else [str(x) for x in stop]
        with ep.lock:
            suffix = self._suffix(tools, kwargs)
            prompt = self._prompt_ids(ep, messages, suffix, tools, kwargs)
            budget = ep.sampling.max_tokens
            if body.get("max_tokens") or body.get("max_completion_tokens"):
                budget = min(budget, int(body.get("max_completion_tokens") or body["max_tokens"]))
            key = next(self._keys)
            seed = ep.seed + len(ep.calls) * _CALL_SEED_STRIDE
            done, failed = self.client.run([Request(key, prompt, seed, affinity=hash(episode))],
                                           replace(ep.sampling, max_tokens=budget), ep.router, self.model())
            if failed:
                raise RuntimeError(failed[key])
            g: Generation = done[key]
            ids, logprobs, versions = list(g.token_ids), list(g.logprobs), list(self.versions(g))
            finish = g.finish_reason
            if stop and (cut := self._stop_at(ids, stop)) is not None:
                # the ids up to the one that completed the stop string: what the server sampled, kept whole
                ids, logprobs, versions, finish = ids[:cut], logprobs[:cut], versions[:cut], "stop"
            ended = bool(ids) and ids[-1] == suffix.end_of_turn_id
            message = self._message(ids, ended, stop, ep.tool_calls, tools)
            ep.calls.append(RecordedCall(prompt, ids, logprobs, versions))
            ep.messages = [*messages]
            ep.reply, ep.ended = message["content"], ended
            if message.get("tool_calls"):
                ep.tool_calls += len(message["tool_calls"])
                finish = "tool_calls"
        return {"id": f"chatcmpl-{episode}-{len(ep.calls)}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", ""),
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids)}}

    def _message(self, ids: list[int], ended: bool, stop: list[str], calls_before: int,
                 tools: list[dict] | None) -> dict:
        """The OpenAI assistant message of a reply: its text (before the first stop string), and the tool calls the
        family's format reads in it (then `content` is the text without them, as the format writes it)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if at := [text.index(x) for x in stop if x in text]:
            text = text[:min(at)]
        # special tokens kept (Mistral's [TOOL_CALLS] is one), the end-of-turn token not
        raw = self.tokenizer.decode(ids[: -1 if ended else None], skip_special_tokens=False)
        calls = [typed(c, tools) for c in self.format.parse(self.family.answer_text(raw)) if not c.error]
        if not calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": self.format.content(raw),
                "tool_calls": [{"id": self.family.call_id(c, calls_before + k), "type": "function",
                                "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                               for k, c in enumerate(calls)]}

    def _stop_at(self, ids: list[int], stop: list[str]) -> int | None:
        """The fewest leading ids whose text holds a stop string (None: none does), by bisection on the prefix."""
        def holds(k: int) -> bool:
            text = self.tokenizer.decode(ids[:k], skip_special_tokens=True)
            return any(x in text for x in stop)

        if not holds(len(ids)):
            return None
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
        return lo

    def _prompt_ids(self, ep: _Episode, messages: list[dict], suffix: ToolSuffix, tools: list[dict] | None,
                    kwargs: dict) -> list[int]:
        """The call's prompt ids: the previous call's ids plus the new messages' suffix when the messages extend it
        (nothing re-tokenised), else the whole conversation rendered. New messages the template cannot append
        without rewriting earlier turns (a user follow-up, for Qwen3 and Mistral's templates) are rendered whole too:
        the stitch rule then starts a new trajectory."""
        k = len(ep.messages)
        if ep.calls and len(messages) > k + 1 and messages[:k] == ep.messages and _is_reply(messages[k], ep.reply):
            last = ep.calls[-1]
            try:
                return [*last.prompt_ids, *last.output_ids, *suffix.ids(messages[k + 1:], ended=ep.ended)]
            except TemplateError:
                pass
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                                      **kwargs)
        except Exception as e:  # noqa: BLE001 - the template refused these messages: the request's fault, a 400
            raise ValueError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from e
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _suffix(self, tools: list[dict] | None, kwargs: dict) -> ToolSuffix:
        key = json.dumps([tools, kwargs], sort_keys=True)
        if key not in self._suffixes:  # renders and checks the family's base conversation: once per tool list
            self._suffixes[key] = ToolSuffix(self.tokenizer, self.family, tools, kwargs)
        return self._suffixes[key]


def _is_reply(message: Any, reply: str) -> bool:
    """Whether `message` is the previous call's reply sent back unchanged (an agent may add `tool_calls` etc.)."""
    return (isinstance(message, dict) and message.get("role") == "assistant"
            and (message.get("content") or "") == reply)


def _handler(endpoint: ChatEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server hook's name
            parts = self.path.strip("/").split("/")
            if len(parts) != 5 or parts[0] != "episodes" or parts[2:] != ["v1", "chat", "completions"]:
                return self._answer(404, {"error": {"message": f"no route {self.path}; use "
                                                               "/episodes/<id>/v1/chat/completions"}})
            try:
                size = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                size = -1
            if not 0 <= size <= MAX_BODY_BYTES:  # read nothing of it; the connection closes after the answer
                self.close_connection = True
                return self._answer(413, {"error": {"message": f"request body of {size} bytes: at most "
                                                               f"{MAX_BODY_BYTES} are read"}})
            try:
                body = json.loads(self.rfile.read(size) or b"{}")
                return self._answer(200, endpoint.complete(parts[1], body))
            except (KeyError, ValueError, TypeError) as e:
                return self._answer(400, {"error": {"message": str(e), "type": "invalid_request_error"}})
            except Exception as e:  # noqa: BLE001 - a server lost: the agent sees a 503, the episode fails
                log.warning("chat endpoint call failed: %s", e)
                return self._answer(503, {"error": {"message": f"{type(e).__name__}: {e}"}})

        def _answer(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):  # one line per call on stderr is noise at thousands of calls a step
            log.debug(fmt, *args)

    return Handler
