"""Generation requests to a vLLM server's token-in/token-out endpoint: token ids in, token ids, log-probs and the
weight version of every token out.

One request per sample (its own seed: vLLM's `n > 1` with a fixed seed draws one sequence n times) to
`/inference/v1/generate` (vLLM's scale-out endpoint, served with `--enable-scale-out`): the prompt is
a list of ids (nothing is re-tokenised), the sampled token's log-prob comes back per token (the
server runs with `--logprobs-mode processed_logprobs`, as the colocated engine does), and so do the
weight-version spans the server's engine core stamps on its outputs: a request paused while the
weights change (asynchronous training) reports which tokens each version sampled.

Requests go from a thread pool, many in flight; each thread has its own HTTP session. `run` waits for
a set of requests; `submit` sends them and returns, their results collected later with `drain`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import requests

from hybrid_rl.engine.vllm_engine import Generation, Sampling
from hybrid_rl.engine.vllm_server import SERVED_MODEL

GENERATE = "/inference/v1/generate"
_ERRORS = (requests.RequestException, RuntimeError, ValueError, KeyError, TypeError)


@dataclass(frozen=True)
class Request:
    key: int  # the caller's id for the sample
    prompt: list[int]
    seed: int


def request_body(prompt: list[int], sampling: Sampling, seed: int) -> dict:
    s = sampling
    return {"model": SERVED_MODEL, "token_ids": prompt,
            "sampling_params": {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                                "top_k": s.top_k, "seed": seed, "stop_token_ids": list(s.stop_token_ids),
                                "logprobs": 0, "n": 1, "detokenize": False}}


def parse_choice(choice: dict) -> Generation:
    """One choice of the endpoint's answer; ValueError for one that is not a whole generation."""
    if choice["finish_reason"] not in ("stop", "length"):
        raise ValueError(f"the request ended with finish_reason={choice['finish_reason']!r}")
    ids = tuple(int(t) for t in choice["token_ids"])
    lps = tuple(float(x["logprob"]) for x in (choice["logprobs"] or {}).get("content") or ())
    if len(lps) != len(ids):
        raise ValueError(f"the server returned {len(ids)} token ids but {len(lps)} log-probs")
    spans = tuple((str(v["version"]), int(v["start"]), int(v["end"])) for v in choice.get("weight_versions") or ())
    if ids and (not spans or spans[0][1] != 0 or spans[-1][2] != len(ids)):
        raise ValueError(f"the server's weight-version spans {spans} do not cover the {len(ids)} tokens")
    return Generation(0, ids, lps, choice["finish_reason"], spans)


class CompletionClient:
    """Sends requests to servers (chosen per request by `route`) with `max_inflight` in flight."""

    def __init__(self, *, max_inflight: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_inflight, thread_name_prefix="rollout-http")
        self._local = threading.local()
        self._arrivals: queue.SimpleQueue[tuple[int, Generation | None, str]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def _one(self, url: str, body: dict) -> Generation:
        r = self._session().post(f"{url}{GENERATE}", json=body, timeout=self.timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"{url}{GENERATE} answered {r.status_code}: {r.text[:500]}")
        return parse_choice(r.json()["choices"][0])

    def run(self, requests_: Iterable[Request], sampling: Sampling,
            route: Callable[[Request], str]) -> tuple[dict[int, Generation], dict[int, str]]:
        """(generations by key, errors by key): a failed request (server gone, error answer) is reported, not raised."""
        futures = {r.key: self.pool.submit(self._one, route(r), request_body(r.prompt, sampling, r.seed))
                   for r in requests_}
        done, failed = {}, {}
        for key, f in futures.items():
            try:
                done[key] = f.result()
            except _ERRORS as e:
                failed[key] = str(e)
        return done, failed

    # -- requests in flight while the caller does something else ---------------------------------

    def submit(self, requests_: Iterable[Request], sampling: Sampling, route: Callable[[Request], str]) -> None:
        """Send the requests and return at once; each result (or error) is kept for `drain`."""
        for r in requests_:
            with self._lock:
                self._in_flight += 1
            f = self.pool.submit(self._one, route(r), request_body(r.prompt, sampling, r.seed))
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
        done, failed = {}, {}
        while True:
            try:
                key, result, error = self._arrivals.get_nowait()
            except queue.Empty:
                return done, failed
            if result is None:
                failed[key] = error
            else:
                done[key] = result

    @property
    def in_flight(self) -> int:
        """Submitted requests not ended yet."""
        return self._in_flight

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
