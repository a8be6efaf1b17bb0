"""Generation requests to a vLLM server's `/v1/completions`: token ids in, token ids and log-probs out.

One request per sample (its own seed: vLLM's `n > 1` with a fixed seed draws one sequence n times),
the prompt given as token ids so nothing is re-tokenised, `return_token_ids` for the response's ids
and `logprobs: 1` for the sampled token's log-prob (the server runs with `--logprobs-mode
processed_logprobs`, as the colocated engine does). Requests go from a thread pool, many in flight;
each thread has its own HTTP session.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

from hybrid_rl.engine.vllm_engine import Generation, Sampling
from hybrid_rl.engine.vllm_server import SERVED_MODEL


@dataclass(frozen=True)
class Request:
    key: int  # the caller's id for the sample (its uid)
    prompt: list[int]
    seed: int


def request_body(prompt: list[int], sampling: Sampling, seed: int) -> dict:
    s = sampling
    return {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": s.max_tokens, "temperature": s.temperature,
            "top_p": s.top_p, "top_k": s.top_k, "seed": seed, "stop_token_ids": list(s.stop_token_ids),
            "logprobs": 1, "return_token_ids": True, "n": 1}


def parse_choice(choice: dict) -> Generation:
    ids = tuple(int(t) for t in choice["token_ids"])
    lps = tuple(float(x) for x in choice["logprobs"]["token_logprobs"])
    if len(lps) != len(ids):
        raise ValueError(f"the server returned {len(ids)} token ids but {len(lps)} log-probs")
    return Generation(0, ids, lps, "length" if choice["finish_reason"] == "length" else "stop")


class CompletionClient:
    """Sends requests to servers (chosen per request by `route`) with `max_inflight` in flight."""

    def __init__(self, *, max_inflight: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_inflight, thread_name_prefix="rollout-http")
        self._local = threading.local()

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def _one(self, url: str, body: dict) -> Generation:
        r = self._session().post(f"{url}/v1/completions", json=body, timeout=self.timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"{url}/v1/completions answered {r.status_code}: {r.text[:500]}")
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
            except (requests.RequestException, RuntimeError, ValueError, KeyError) as e:
                failed[key] = str(e)
        return done, failed

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
