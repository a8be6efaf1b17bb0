"""The run's secret: who may drive its vLLM servers and whose etcd values it believes.

Every sidecar run has one random secret, kept in `<output_dir>/secret` (mode 0600, created exclusively)
and carried to the processes of the run by environment (`HYBRID_RL_SECRET`), never on a command line
(`/proc/<pid>/cmdline` is world-readable; a process's environment is readable by its own user only).
Two keys are derived from it, so neither use exposes the other:

* the servers' bearer token (`server_token`): each vLLM server gets it in `HYBRID_RL_SERVER_TOKEN` and
  `ServerGuard` (a `--middleware`) refuses every request without it, `/health` and `/metrics` included.
  vLLM's own `--api-key` guards only `/v1`, `/v2`, `/inference` and `/cohere`, not the RL endpoints
  (`/collective_rpc`, `/init_weight_transfer_engine`, `/update_weight_version`, `/sleep`, `/pause`...);
* the etcd signing key (`etcd_key`): every value the run writes to etcd is signed with it (`etcd.py`).

The middleware is imported by the vLLM server process only (no vLLM or starlette import here: it is a
plain ASGI class).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
from pathlib import Path

SECRET_ENV = "HYBRID_RL_SECRET"  # the run's secret, in the trainer's and the pods' environment
TOKEN_ENV = "HYBRID_RL_SERVER_TOKEN"  # the servers' bearer token, in a server's environment only
NAMESPACE_ENV = "HYBRID_RL_SHM_NAMESPACE"  # the one shared-memory namespace a server's transfer backend maps
SECRET_FILE = "secret"
MIDDLEWARE = "hybrid_rl.sidecar.auth.ServerGuard"


class SecretError(RuntimeError):
    """The run's secret is missing, or its file is not private to this user."""


def check_private(path: Path, st: os.stat_result | None = None) -> None:
    """SecretError unless `path` is a regular file of this user that no one else may read or write."""
    st = st or os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise SecretError(f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise SecretError(f"{path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): refused")
    if st.st_mode & 0o077:
        raise SecretError(f"{path} has mode {stat.S_IMODE(st.st_mode):o}: others may read or write it; "
                          f"it must be 0600 (chmod 600 {path})")


def read_secret(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        check_private(path, os.fstat(fd))
        value = os.read(fd, 4096).decode().strip()
    finally:
        os.close(fd)
    if len(value) < 32:
        raise SecretError(f"{path} holds no secret (fewer than 32 characters)")
    return value


def load_or_create_secret(folder: str | Path) -> str:
    """The secret in `folder/secret`: read (checked private), or made (random, 256 bits) and written 0600. Written
    aside and linked into place, so a reader (a pod waiting for it) never sees a partial file."""
    path = Path(folder) / SECRET_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(path):
        return read_secret(path)
    value = secrets.token_hex(32)
    tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (value + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process made it first: theirs is the run's
    except FileExistsError:
        return read_secret(path)
    finally:
        tmp.unlink()
    return value


def install_secret(value: str) -> None:
    """This process's run secret (its children inherit it)."""
    os.environ[SECRET_ENV] = value


def run_secret() -> str:
    """The run's secret; a process that has none (a test driving one server) makes one for itself."""
    if not os.environ.get(SECRET_ENV):
        install_secret(secrets.token_hex(32))
    return os.environ[SECRET_ENV]


def derive(purpose: str, secret: str | None = None) -> bytes:
    return hmac.new((secret or run_secret()).encode(), purpose.encode(), hashlib.sha256).digest()


def server_token(secret: str | None = None) -> str:
    return derive("vllm-server-token", secret).hex()


def etcd_key(secret: str | None = None) -> bytes:
    return derive("etcd-values", secret)


def auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {server_token()}"}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_secret_for(host: str) -> None:
    """SecretError when a server would listen on a non-loopback address and this process has no run secret."""
    if not is_loopback(host) and not os.environ.get(SECRET_ENV):
        raise SecretError(f"sidecar.host={host} is reachable from other machines and this process has no run secret "
                          f"({SECRET_ENV}, or the trainer's <output_dir>/{SECRET_FILE}): refused")


class ServerGuard:
    """ASGI middleware for the vLLM server: every HTTP request and websocket must carry `Authorization: Bearer
    <token>` (401 otherwise). The server refuses to start without a token in its environment."""

    def __init__(self, app):
        token = os.environ.get(TOKEN_ENV, "")
        if len(token) < 32:
            raise RuntimeError(f"{TOKEN_ENV} is not set: a hybrid_rl sidecar server does not start unguarded")
        self.app = app
        self.digest = hashlib.sha256(token.encode()).digest()

    def allowed(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, given = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(hashlib.sha256(given.strip().encode()).digest(), self.digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": b'{"error": "unauthorized"}'})


def share_run_secret(folder: str | Path, *, rank: int, broadcast) -> str:
    """Collective: rank 0 reads or makes the run's secret in `folder`; every rank installs it. Returns this launch's
    random nonce (the same on every rank), which makes the shared-memory ring names unguessable before they exist.
    `broadcast`: rank 0's object to every rank (`distributed.collectives.broadcast_object`)."""
    secret, nonce, error = "", "", ""
    if rank == 0:
        try:
            secret, nonce = load_or_create_secret(folder), secrets.token_hex(8)
        except (OSError, SecretError) as e:
            error = f"the run's secret in {Path(folder) / SECRET_FILE}: {e}"
    secret, nonce, error = broadcast((secret, nonce, error))
    if error:
        raise SecretError(error)
    install_secret(secret)
    return nonce
