"""Coordination through etcd (v3, over its HTTP gateway, with the maintained `etcd3gw` client).

Sidecar mode keeps three kinds of keys under one prefix per run:

* `<prefix>/servers/<pod>`: each vLLM sidecar's endpoint, TP size and loaded weight version, under a
  lease that its supervisor keeps alive (`Registration`): a dead pod's key expires and drops out;
* `<prefix>/version`: the trainer's latest weight version and its shard manifest;
* `<prefix>/pods/...`: where the pods' checkpoint engines meet (the broadcast group's address).

Every value is signed with the run's key (`auth.etcd_key`, an HMAC over the full key name and the value's
JSON text) and a value that does not verify is dropped as if absent: a user who can write to etcd (it
has no auth by default) can neither list a server of theirs for the run's requests nor name a pod group
for its pods. (A signed value of the same key can still be replayed; a deleted key cannot be restored
by a stranger with fresh content.)

etcd being unreachable is not fatal by itself: every call retries for `wait_s` seconds, logging
what it waits for, and only then raises `EtcdUnavailable`, naming the endpoint. A lease that expired
while etcd was away is granted again and its keys written again as soon as etcd answers.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlparse

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_errors

from hybrid_rl.sidecar.auth import etcd_key

log = logging.getLogger(__name__)

T = TypeVar("T")
_UNREACHABLE = (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError)


class EtcdUnavailable(RuntimeError):
    """etcd did not answer within the configured wait."""


class Etcd:
    """A JSON key-value view of one etcd prefix, waiting out etcd outages of up to `wait_s` seconds."""

    def __init__(self, endpoint: str, prefix: str, *, wait_s: float, request_timeout_s: float = 5.0,
                 sign_key: bytes | None = None):
        url = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
        if not url.hostname or not url.port:
            raise ValueError(f"etcd endpoint {endpoint!r}: expected http://HOST:PORT")
        self.endpoint, self.prefix, self.wait_s = f"{url.scheme}://{url.hostname}:{url.port}", prefix.rstrip("/"), wait_s
        self.client = etcd3gw.client(host=url.hostname, port=url.port, protocol=url.scheme,
                                     timeout=request_timeout_s, api_path="/v3/", session=tls_session(url.scheme))
        self._user = (os.environ.get(USER_ENV, ""), os.environ.get(PASSWORD_ENV, ""))
        if self._user[0]:
            self.call("authenticating", self._authenticate)
        self._sign_key = sign_key  # None: the run's (`auth.etcd_key`, from this process's run secret)
        self.dropped = 0  # values that did not verify (logged once per key)
        self._warned: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def check(self) -> None:
        """One quick call: EtcdUnavailable at once when nothing answers (used at start-up, before heavy work)."""
        try:
            self.client.status()
        except _UNREACHABLE as e:
            raise EtcdUnavailable(f"etcd at {self.endpoint} (sidecar.etcd) is unreachable ({_why(e)}). Start etcd there "
                                  "(`etcd --listen-client-urls ... --advertise-client-urls ...`) or point "
                                  "sidecar.etcd at a running one") from None

    def _authenticate(self) -> None:
        """etcd's user auth (`HYBRID_RL_ETCD_USER` and `_PASSWORD`): a token every later request carries."""
        name, password = self._user
        self.client.session.headers.pop("Authorization", None)  # etcd refuses a request carrying an expired token
        answer = self.client.post(self.client.get_url("/auth/authenticate"), json={"name": name, "password": password})
        self.client.session.headers["Authorization"] = answer["token"]

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()`, retried while etcd is unreachable, for `wait_s` seconds at most (and once after authenticating
        again when etcd's auth token expired)."""
        deadline, warned = time.monotonic() + self.wait_s, False
        while True:
            try:
                try:
                    result = fn()
                except etcd_errors.Etcd3Exception as e:
                    if not self._user[0] or isinstance(e, _UNREACHABLE) or \
                            "auth token" not in (e.detail_text or ""):
                        raise
                    self._authenticate()
                    result = fn()
                if warned:
                    log.warning("etcd at %s answers again; going on", self.endpoint)
                return result
            except _UNREACHABLE as e:
                if time.monotonic() > deadline:
                    raise EtcdUnavailable(f"etcd at {self.endpoint} unreachable for {self.wait_s:.0f} s "
                                          f"(sidecar.etcd_wait_s) while {what} ({_why(e)})") from None
                if not warned:
                    log.warning("etcd at %s is unreachable (%s); waiting up to %.0f s for it to come back",
                                self.endpoint, what, self.wait_s)
                    warned = True
                time.sleep(0.5)

    # -- JSON values -----------------------------------------------------------------------------

    @property
    def sign_key(self) -> bytes:
        return self._sign_key or etcd_key()

    def seal(self, full_key: str, value: Any) -> str:
        text = json.dumps(value)
        return json.dumps({"value": text, "sig": _mac(self.sign_key, full_key, text)})

    def open(self, full_key: str, stored: bytes | str) -> Any | None:
        """The value stored under `full_key`, or None (logged once per key) when it is not signed with the run's key."""
        try:
            envelope = json.loads(_text(stored))
            text, sig = envelope["value"], envelope["sig"]
            if isinstance(text, str) and isinstance(sig, str) and \
                    hmac.compare_digest(sig, _mac(self.sign_key, full_key, text)):
                return json.loads(text)
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            pass
        self.dropped += 1
        if full_key not in self._warned:
            self._warned.add(full_key)
            log.warning("etcd key %s holds a value not signed with this run's key: ignored (another user's, or "
                        "another run's)", full_key)
        return None

    def put(self, name: str, value: Any, *, lease=None) -> None:
        key = self.key(name)
        self.call(f"writing {name}", lambda: self.client.put(key, self.seal(key, value), lease=lease))

    def get(self, name: str) -> Any | None:
        values = self.call(f"reading {name}", lambda: self.client.get(self.key(name)))
        return self.open(self.key(name), values[0]) if values else None

    def get_prefix(self, name: str) -> dict[str, Any]:
        """Every key under `<prefix>/<name>/` whose value verifies, by the rest of its name."""
        base = self.key(name) + "/"
        rows = self.call(f"listing {name}", lambda: self.client.get_prefix(base))
        out = {}
        for value, meta in rows:
            key = _text(meta["key"])
            if (opened := self.open(key, value)) is not None:
                out[key[len(base):]] = opened
        return out

    def delete(self, name: str) -> None:
        self.call(f"deleting {name}", lambda: self.client.delete(self.key(name)))

    def delete_all(self) -> None:
        self.call("deleting the run's keys", lambda: self.client.delete_prefix(self.prefix + "/"))


class Registration:
    """A key kept alive under a lease by a background thread; `update` changes its value.

    The thread refreshes the lease every `ttl/3` seconds. When etcd was away long enough for the lease
    to expire (or etcd lost it), a new lease is granted and the key written again, so a pod reappears
    on its own once etcd is back. `close` revokes the lease: the key goes at once.
    """

    def __init__(self, etcd: Etcd, name: str, value: Any, *, ttl_s: int):
        self.etcd, self.name, self.ttl_s = etcd, name, ttl_s
        self._value = value
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.lease = None
        self._write()
        self._thread = threading.Thread(target=self._keep_alive, name=f"etcd-lease-{name}", daemon=True)
        self._thread.start()

    @property
    def value(self) -> Any:
        return self._value

    def update(self, value: Any) -> None:
        with self._lock:
            self._value = value
            try:
                self.etcd.put(self.name, value, lease=self.lease)
                return
            except etcd_errors.Etcd3Exception as e:  # the lease is gone (an etcd that lost its data): grant one
                if isinstance(e, _UNREACHABLE):
                    raise
                log.warning("etcd lease of %s: %s; registering it again", self.name, e)
        self._write()

    def _write(self) -> None:
        with self._lock:
            self.lease = self.etcd.call(f"granting a lease for {self.name}", lambda: self.etcd.client.lease(self.ttl_s))
            self.etcd.put(self.name, self._value, lease=self.lease)

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.lease.refresh() <= 0:  # expired while etcd was away: register again
                    log.warning("etcd lease of %s expired; registering it again", self.name)
                    self._write()
            except _UNREACHABLE:
                continue  # etcd away: try again next period (the key comes back with a new lease if needed)
            except etcd_errors.Etcd3Exception as e:
                log.warning("etcd lease of %s: %s; registering it again", self.name, e)
                try:
                    self._write()
                except (EtcdUnavailable, etcd_errors.Etcd3Exception):
                    continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.lease.revoke()
        except etcd_errors.Etcd3Exception:
            pass  # etcd away: the key expires with its lease


def _mac(key: bytes, full_key: str, text: str) -> str:
    return hmac.new(key, f"{full_key}\0{text}".encode(), hashlib.sha256).hexdigest()


USER_ENV, PASSWORD_ENV = "HYBRID_RL_ETCD_USER", "HYBRID_RL_ETCD_PASSWORD"  # etcd's user auth (never in a config)
TLS_ENV = {"ca_cert": "HYBRID_RL_ETCD_CA", "cert_cert": "HYBRID_RL_ETCD_CERT", "cert_key": "HYBRID_RL_ETCD_KEY"}


def tls_session(scheme: str) -> requests.Session:
    """etcd over TLS (`sidecar.etcd=https://HOST:PORT`): the CA that signed etcd's certificate and this client's own
    certificate and key (etcd's `--client-cert-auth`), from `HYBRID_RL_ETCD_CA`, `_CERT` and `_KEY`. The session
    ignores `REQUESTS_CA_BUNDLE` and the like, which requests would otherwise prefer to the CA given here."""
    env = {arg: os.environ[name] for arg, name in TLS_ENV.items() if os.environ.get(name)}
    if env and scheme != "https":
        raise ValueError(f"{', '.join(TLS_ENV[a] for a in env)} set but sidecar.etcd is not https://")
    session = requests.Session()
    if "ca_cert" in env:
        session.trust_env = False
        session.verify = env["ca_cert"]
    if "cert_cert" in env and "cert_key" in env:
        session.cert = (env["cert_cert"], env["cert_key"])
    return session


def _text(b: bytes | str) -> str:
    return b.decode() if isinstance(b, bytes) else b


def _why(e: Exception) -> str:
    return str(e).strip() or type(e).__name__
