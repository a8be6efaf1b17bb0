"""One vLLM server's weight-transfer session, driven over vLLM's HTTP endpoints from one background thread.

The requests of an update must reach the server in order (init once per server start and ring, pause,
start, one update per bucket, finish, stamp, resume) while the caller goes on filling the next bucket,
so they are queued on a single worker thread. Errors are collected, not raised in the thread: the
caller asks `error()` whenever it is safe to stop (the trainer's ranks agree on it first).

Partial rollouts: generation is paused with vLLM's `keep` mode for the whole update, so requests in
flight (asynchronous training keeps some there while the trainer updates) are frozen, keeping their
tokens and sampling state, and no token is ever sampled from half-loaded weights. Before the resume
the prefix cache is reset, running requests included: its blocks hold KV computed with the old
weights, which a new request with a cached prompt (a group's other samples, a held-out prompt seen
before) would otherwise reuse; the requests in flight recompute theirs (prompt and tokens so far) under
the new weights, so every token after an update is sampled from the new policy given the tokens
before it. The server stamps each token with the version it was sampled under (the stamp comes before
the resume). Nothing is in flight in synchronous runs: there the pause costs two HTTP calls and the
reset drops cached prompts only.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from hybrid_rl.sidecar.vllm_server import VLLMServer
from hybrid_rl.weightsync.reshard import WeightSyncError


class ServerUpdate:
    def __init__(self, namespace: str, *, timeout_s: float):
        self.namespace, self.timeout_s = namespace, timeout_s
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="server-update")
        self.pending: list[Future] = []
        self.server: VLLMServer | None = None
        self._ring_files = 0  # bumped when the ring's files change: the server must map them again
        self._open = False  # a weight-update session is open on the server

    def reinit(self) -> None:
        """The ring's files changed: the server must map them again."""
        self._ring_files += 1

    def begin(self, server: VLLMServer) -> None:
        self.server, self.pending = server, []
        self.pending.append(self.pool.submit(self._start, server))

    def _start(self, server: VLLMServer) -> None:
        # The server's backend maps one ring at a time: initialise it after each start of the server, change of
        # the ring's files, or update from another writer (another namespace) in between.
        key = (server.starts, self.namespace, id(self), self._ring_files)
        if server.transfer_key != key:
            server.post("/init_weight_transfer_engine",
                        {"init_info": {"namespace": self.namespace, "timeout_s": self.timeout_s}})
            server.transfer_key = key
        server.post("/pause?mode=keep", timeout_s=self.timeout_s)
        server.post("/start_weight_update", timeout_s=self.timeout_s)
        self._open = True  # vLLM refuses the next start until this session is finished

    def bucket(self, seq: int, k: int) -> None:
        """Ask the server to load bucket `k` (ring sequence number `seq`) once it is in its slot."""
        self.pending.append(self.pool.submit(self.server.post, "/update_weights",
                                             {"update_info": {"seq": seq, "bucket": k}}, timeout_s=self.timeout_s))

    def error(self, *, wait: bool = False) -> str:
        """The first failed request's error ("" when none failed; with `wait`, after all have finished)."""
        for f in self.pending:
            if (wait or f.done()) and f.exception() is not None:
                return str(f.exception())
        return ""

    def finish(self) -> str:
        """Finish the update (the server writes its verification reports); the session's first error, if any."""
        self.pending.append(self.pool.submit(self._finish))
        return self.error(wait=True)

    def _finish(self) -> None:
        self.server.post("/finish_weight_update", timeout_s=self.timeout_s)
        self._open = False

    def stamp(self, version: str) -> None:
        """After verification: the server's weights are `version` (and it says so)."""
        self.server.post("/update_weight_version", {"new_version": version})
        if (got := self.server.weight_version()) != version:
            raise WeightSyncError(f"the vLLM server reports weight version {got!r} after stamping {version!r}")

    def end(self, *, ok: bool) -> str:
        """Resume generation after the update, the prefix cache reset (running requests recompute their KV). After
        a failed update the requests in flight are aborted (their callers see them fail and send them again) and
        the server stays paused: its weights are partly the new ones under the old version label, so nothing may
        be sampled from it until a full verified update lands (the next one pauses, loads, stamps and resumes it;
        its owner also withdraws it from dispatch). Returns "" or why the server did not answer (a dead server
        resumes nothing; a restarted one starts unpaused, from dummy weights, with no version)."""
        if self.server is None:
            return ""
        if not ok:
            return self.pool.submit(self._abandon).result()
        # Preempting the running requests frees their blocks, so the reset cannot fail on them.
        problem = ""
        try:
            answer = self.pool.submit(self.server.post, "/reset_prefix_cache?reset_running_requests=true",
                                      timeout_s=self.timeout_s).result()
            if not answer.get("success", False):
                problem = "the server did not reset its prefix cache: new requests may reuse KV of the old weights"
        except Exception as e:  # noqa: BLE001 - reported; resuming matters more (a paused server hangs its callers)
            problem = f"/reset_prefix_cache: {e}"
        try:
            self.pool.submit(self.server.post, "/resume", timeout_s=self.timeout_s).result()
        except Exception as e:  # noqa: BLE001 - reported; the caller's own error (if any) says more
            return f"{problem}; {e}" if problem else str(e)
        return problem

    def _abandon(self) -> str:
        """After a failed update: close the server's session (vLLM refuses the next start while one is open), abort
        its requests and leave it paused. A server that cannot do that is stopped: its owner restarts it from
        dummy weights before the next update (`Sidecar.ensure_running`)."""
        if not self.server.running():
            return ""
        try:
            if self._open:
                self._finish()  # what landed so far stays in place; the next update overwrites all of it
            self.server.post("/pause?mode=abort", timeout_s=self.timeout_s)
            return ""
        except Exception as e:  # noqa: BLE001 - reported; the caller's own error says more
            self.server.stop()
            self._open = False
            return f"could not close the abandoned update ({e}): server stopped, to be restarted from dummy weights"

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
