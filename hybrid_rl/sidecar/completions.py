"""Generation requests to a vLLM server's token-in/token-out endpoint: token ids in, token ids, log-probs and the
weight version of every token out.

One request per sample (its own seed: vLLM's `n > 1` with a fixed seed draws one sequence n times) to
`/inference/v1/generate` (vLLM's scale-out endpoint, served with `--enable-scale-out`): the prompt is
a list of ids (nothing is re-tokenised), the sampled token's log-prob comes back per token (the
server runs with `--logprobs-mode processed_logprobs`, as the colocated engine does), and so do the
weight-version spans the server's engine core stamps on its outputs: a request paused while the
weights change (asynchronous training) reports which tokens each version sampled.

Each answer is streamed (`"stream": true`: a server-sent event per step of new tokens), so a request fails when no
token arrives for `progress_timeout_s` (the server stopped making progress), however long the whole response:
a long generation is not an error. (A request paused by a weight update makes no progress while it is paused:
the progress timeout must exceed an update's length.)

Requests go from a thread pool, many in flight; each thread has its own HTTP session. `run` waits for
a set of requests; `submit` sends them and returns, their results collected later with `drain`. A
`Router` picks each request's server: the one with the fewest outstanding tokens (prompt plus token
budget of the requests in flight), except that requests of one trajectory (`Request.affinity`: a
group's samples share their prompt, a multi-turn episode its history) stay on the server that got the
first one, so its prefix cache serves the rest.
"""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import requests

from hybrid_rl.rollout.speculative import counts_of
from hybrid_rl.sidecar.auth import auth_headers
from hybrid_rl.sidecar.vllm_server import SERVED_MODEL
from hybrid_rl.types import Generation, Request, Sampling

GENERATE = "/inference/v1/generate"
_ERRORS = (requests.RequestException, RuntimeError, ValueError, KeyError, TypeError)
CONNECT_TIMEOUT_S = 30.0  # a server that does not even accept the connection


UNAVAILABLE = "http://server-unavailable.invalid"  # no server listed: every request fails and the caller recovers




class Router:
    """Least outstanding tokens, with trajectory affinity. Shared by the clients of one rank; each rank balances
    its own requests (the ranks' shares are alike)."""

    def __init__(self, max_sticky: int = 100_000):
        self._lock = threading.Lock()
        self.load: dict[str, int] = {}
        self._sticky: OrderedDict[int, str] = OrderedDict()
        self.max_sticky = max_sticky

    def set_servers(self, urls: list[str]) -> None:
        """The servers at the current weights; trajectories on a server that left are placed again."""
        with self._lock:
            self.load = {u: self.load.get(u, 0) for u in urls}

    def pick(self, r: Request, cost: int) -> str:
        with self._lock:
            if not self.load:
                return UNAVAILABLE
            key = r.key if r.affinity is None else r.affinity
            url = self._sticky.get(key)
            if url not in self.load:
                url = min(self.load, key=lambda u: self.load[u])
                self._sticky[key] = url
                if len(self._sticky) > self.max_sticky:
                    self._sticky.popitem(last=False)
            self._sticky.move_to_end(key)
            self.load[url] += cost
            return url

    def done(self, url: str, cost: int) -> None:
        with self._lock:
            if url in self.load:
                self.load[url] = max(0, self.load[url] - cost)


def drain_arrivals(arrivals: queue.SimpleQueue) -> tuple[dict, dict[int, str]]:
    """(results by key, errors by key) of what `arrivals` holds now: (key, result or None, error) items."""
    done, failed = {}, {}
    while True:
        try:
            key, result, error = arrivals.get_nowait()
        except queue.Empty:
            return done, failed
        if result is None:
            failed[key] = error
        else:
            done[key] = result


def request_cost(r: Request, sampling: Sampling) -> int:
    return len(r.prompt) + sampling.max_tokens


def request_body(prompt: list[int], sampling: Sampling, seed: int, model: str = SERVED_MODEL) -> dict:
    """`model`: the served base, or a LoRA adapter version loaded under that name (`model.lora.sync=adapter`)."""
    s = sampling
    return {"model": model, "token_ids": prompt,
            "sampling_params": {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                                "top_k": s.top_k, "seed": seed, "stop_token_ids": list(s.stop_token_ids),
                                "logprobs": 0, "n": 1, "detokenize": False},
            # the last event then carries the usage and, with `rollout.speculative`, the drafted and accepted tokens
            "stream": True, "stream_options": {"include_usage": True}}


def parse_choice(choice: dict, *, max_tokens: int | None = None, vocab: int | None = None) -> Generation:
    """One choice of the endpoint's answer; ValueError for one that is not a whole generation, or that a correct
    server could not have sent for the request (more than `max_tokens` tokens, an id outside the model's `vocab`,
    a log-prob that is not a finite number <= 0): such an answer would crash the trainer's gather or weigh a
    token without bound."""
    if choice["finish_reason"] not in ("stop", "length"):
        raise ValueError(f"the request ended with finish_reason={choice['finish_reason']!r}")
    ids = tuple(int(t) for t in choice["token_ids"])
    lps = tuple(float(x["logprob"]) for x in (choice["logprobs"] or {}).get("content") or ())
    if len(lps) != len(ids):
        raise ValueError(f"the server returned {len(ids)} token ids but {len(lps)} log-probs")
    if max_tokens is not None and len(ids) > max_tokens:
        raise ValueError(f"the server returned {len(ids)} tokens for a request of at most {max_tokens}")
    if vocab is not None and ids and not 0 <= min(ids) <= max(ids) < vocab:
        raise ValueError(f"the server returned token ids outside the model's vocabulary [0, {vocab}): "
                         f"{[t for t in ids if not 0 <= t < vocab][:5]}")
    if not all(math.isfinite(x) and x <= 0.0 for x in lps):
        raise ValueError(f"the server returned log-probs that are not finite numbers <= 0: "
                         f"{[x for x in lps if not (math.isfinite(x) and x <= 0.0)][:5]}")
    spans = tuple((str(v["version"]), int(v["start"]), int(v["end"])) for v in choice.get("weight_versions") or ())
    if ids and (not spans or spans[0][1] != 0 or spans[-1][2] != len(ids)):
        raise ValueError(f"the server's weight-version spans {spans} do not cover the {len(ids)} tokens")
    return Generation(0, ids, lps, choice["finish_reason"], spans)


def parse_stream(lines: Iterable[bytes | str], *, max_tokens: int | None = None,
                 vocab: int | None = None) -> Generation:
    """The server-sent events of one streamed request (n = 1), joined into one choice for `parse_choice`: token ids
    and log-probs arrive per step, the finish reason and weight-version spans with the last step."""
    ids, lps, finish, spans, spec = [], [], None, None, None
    for line in lines:
        line = line.decode() if isinstance(line, bytes) else line
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"the server failed the request mid-stream: {str(event['error'])[:500]}")
        for choice in event.get("choices") or ():
            ids += choice.get("token_ids") or ()
            lps += (choice.get("logprobs") or {}).get("content") or ()
            finish = choice.get("finish_reason") or finish
            spans = choice.get("weight_versions") or spans
        spec = (event.get("metrics") or {}).get("speculative_decoding") or spec
    if finish is None:
        raise ValueError("the server's stream ended before the request finished")
    g = parse_choice({"token_ids": ids, "logprobs": {"content": lps}, "finish_reason": finish,
                      "weight_versions": spans}, max_tokens=max_tokens, vocab=vocab)
    drafted, accepted = counts_of(spec)
    return dataclasses.replace(g, spec_drafted=drafted, spec_accepted=accepted) if drafted else g


class CompletionClient:
    """Sends requests to servers (chosen per request by a `Router`) with `max_inflight` in flight; a request fails
    when no token arrives for `progress_timeout_s`."""

    def __init__(self, *, max_inflight: int, progress_timeout_s: float, vocab: int | None = None):
        self.max_inflight, self.progress_timeout_s = max_inflight, progress_timeout_s
        self.vocab = vocab  # the model's vocabulary size: answers with other ids are refused (`parse_choice`)
        self.pool = ThreadPoolExecutor(max_inflight, thread_name_prefix="rollout-http")
        self._local = threading.local()
        self._arrivals: queue.SimpleQueue[tuple[int, Generation | None, str]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0

    def resize(self, max_inflight: int) -> None:
        """A new cap on requests in flight (sized once the servers' KV capacity is known); requests already sent go
        on on the old threads."""
        if max_inflight != self.max_inflight:
            old, self.max_inflight = self.pool, max_inflight
            self.pool = ThreadPoolExecutor(max_inflight, thread_name_prefix="rollout-http")
            old.shutdown(wait=False)

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
            self._local.session.headers.update(auth_headers())  # the servers refuse requests without the run's token
        return self._local.session

    def _one(self, url: str, body: dict) -> Generation:
        # requests' read timeout bounds each wait for the next bytes, not the whole response: a progress timeout.
        timeout = (min(CONNECT_TIMEOUT_S, self.progress_timeout_s), self.progress_timeout_s)
        with self._session().post(f"{url}{GENERATE}", json=body, timeout=timeout, stream=True) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{url}{GENERATE} answered {r.status_code}: {r.text[:500]}")
            try:
                g = parse_stream(r.iter_lines(), max_tokens=body["sampling_params"]["max_tokens"], vocab=self.vocab)
            except requests.ConnectionError as e:  # a read timeout mid-stream surfaces as a connection error
                raise RuntimeError(f"{url}{GENERATE}: no token for {self.progress_timeout_s:.0f} s "
                                   f"(sidecar.progress_timeout_s) or the connection broke: {e}") from None
        if body["model"] != SERVED_MODEL and g.token_ids:
            # A LoRA adapter version: the base never changes after its one load, so every token of the request was
            # sampled under the adapter it named (the server's stamps say which base-and-adapter update was last).
            g = dataclasses.replace(g, weight_spans=((body["model"], 0, len(g.token_ids)),))
        return g

    def _send(self, r: Request, sampling: Sampling, router: Router, model: str = SERVED_MODEL) -> Future:
        cost = request_cost(r, sampling)
        url = router.pick(r, cost)
        f = self.pool.submit(self._one, url, request_body(r.prompt, sampling, r.seed, model))
        f.add_done_callback(lambda _: router.done(url, cost))
        return f

    def run(self, requests_: Iterable[Request], sampling: Sampling, router: Router,
            model: str = SERVED_MODEL) -> tuple[dict[int, Generation], dict[int, str]]:
        """(generations by key, errors by key): a failed request (server gone, error answer) is reported, not raised."""
        futures = {r.key: self._send(r, sampling, router, model) for r in requests_}
        done, failed = {}, {}
        for key, f in futures.items():
            try:
                done[key] = f.result()
            except _ERRORS as e:
                failed[key] = str(e)
        return done, failed

    # -- requests in flight while the caller does something else ---------------------------------

    def submit(self, requests_: Iterable[Request], sampling: Sampling, router: Router,
               model: str = SERVED_MODEL) -> None:
        """Send the requests and return at once; each result (or error) is kept for `drain`."""
        for r in requests_:
            with self._lock:
                self._in_flight += 1
            f = self._send(r, sampling, router, model)
            f.add_done_callback(lambda f, key=r.key: self._arrived(key, f))

    def _arrived(self, key: int, f: Future) -> None:
        if f.cancelled():
            result, error = None, "cancelled"
        else:
            try:
                result, error = f.result(), ""
            except _ERRORS as e:
                result, error = None, str(e) or type(e).__name__
        with self._lock:
            self._in_flight -= 1
        self._arrivals.put((key, result, error))

    def drain(self) -> tuple[dict[int, Generation], dict[int, str]]:
        """(generations by key, errors by key) of the submitted requests that ended since the last call."""
        return drain_arrivals(self._arrivals)

    @property
    def in_flight(self) -> int:
        """Submitted requests not ended yet."""
        return self._in_flight

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
