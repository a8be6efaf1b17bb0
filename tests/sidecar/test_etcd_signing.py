"""Values in etcd are believed only when signed with the run's key (a real etcd, written to by a stranger: raw
unsigned JSON, and values signed with another key); etcd's own user auth and TLS client certificates work."""

import json
import secrets
import subprocess

import pytest
import requests
from etcd3gw.exceptions import Etcd3Exception

from hybrid_rl.distributed.mesh import free_port
from hybrid_rl.pod import _wait_for
from hybrid_rl.sidecar.auth import etcd_key
from hybrid_rl.sidecar.etcd import Etcd, Registration
from hybrid_rl.sidecar.etcd_server import EtcdProcess
from hybrid_rl.sidecar.pod_link import GROUP_KEY
from hybrid_rl.sidecar.versions import servers_at

pytestmark = pytest.mark.slow
PREFIX = "/hybrid_rl/signed/run1"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    proc = EtcdProcess(tmp_path_factory.mktemp("etcd") / "data")
    proc.start()
    yield proc
    proc.stop()


def test_a_foreign_server_entry_at_the_current_version_is_ignored(etcd):
    run = Etcd(etcd.endpoint, PREFIX, wait_s=5)
    stranger = Etcd(etcd.endpoint, PREFIX, wait_s=5, sign_key=secrets.token_bytes(32))
    own = Registration(run, "servers/pod0", {"url": "http://own:8000", "version": "run1-v3"}, ttl_s=10)
    try:
        # the stranger's entries: signed with another key, and plain unsigned JSON as the code wrote them before
        stranger.put("servers/pod9", {"url": "http://evil:8000", "version": "run1-v3"})
        run.client.put(run.key("servers/pod8"), json.dumps({"url": "http://evil2:8000", "version": "run1-v3"}))
        assert servers_at(run, "run1-v3") == ["http://own:8000"]
        assert run.dropped >= 2
        # a signed value moved to another key does not verify there either (the key name is signed)
        stored = run.client.get(run.key("servers/pod0"))[0]
        run.client.put(run.key("servers/pod7"), stored)
        assert servers_at(run, "run1-v3") == ["http://own:8000"]
    finally:
        own.close()
        run.client.delete_prefix(PREFIX + "/")


def test_a_forged_pod_group_is_refused_and_the_runs_own_is_joined(etcd):
    run = Etcd(etcd.endpoint, PREFIX, wait_s=5)
    forged = {"host": "198.51.100.7", "port": 29500, "tp": 1, "pods": 2}
    try:
        run.client.put(run.key(GROUP_KEY), json.dumps(forged))
        with pytest.raises(TimeoutError, match="no trainer published"):
            _wait_for(run, GROUP_KEY, 2)
        Etcd(etcd.endpoint, PREFIX, wait_s=5, sign_key=secrets.token_bytes(32)).put(GROUP_KEY, forged)
        with pytest.raises(TimeoutError, match="no trainer published"):
            _wait_for(run, GROUP_KEY, 2)
        real = {"host": "127.0.0.1", "port": 29511, "tp": 1, "pods": 2}
        Etcd(etcd.endpoint, PREFIX, wait_s=5, sign_key=etcd_key()).put(GROUP_KEY, real)
        assert _wait_for(run, GROUP_KEY, 2) == real
    finally:
        run.client.delete_prefix(PREFIX + "/")


def test_etcd_user_auth_is_used_and_a_client_without_it_is_refused(tmp_path, monkeypatch):
    proc = EtcdProcess(tmp_path / "data")
    proc.start()
    try:
        api = proc.endpoint + "/v3"
        for path, body in [("/auth/role/add", {"name": "root"}), ("/auth/user/add", {"name": "root", "password": "pw"}),
                           ("/auth/user/grant", {"user": "root", "role": "root"}), ("/auth/enable", {})]:
            assert requests.post(api + path, json=body, timeout=10).ok, path
        with pytest.raises(Etcd3Exception) as refused:
            Etcd(proc.endpoint, PREFIX, wait_s=2).put("version", {"v": 1})
        assert "user name is empty" in refused.value.detail_text
        monkeypatch.setenv("HYBRID_RL_ETCD_USER", "root")
        monkeypatch.setenv("HYBRID_RL_ETCD_PASSWORD", "pw")
        store = Etcd(proc.endpoint, PREFIX, wait_s=2)
        store.put("version", {"v": 1})
        assert store.get("version") == {"v": 1}
        store.client.session.headers["Authorization"] = "expired"  # an expired token: authenticated again
        assert store.get("version") == {"v": 1}
    finally:
        proc.stop()


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def test_etcd_over_tls_with_client_certificates(tmp_path, monkeypatch):
    d = tmp_path
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(d / f"{name}.key"),
                 "-out", str(d / f"{name}.csr"))
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
                 "-CAcreateserial", "-days", "1", "-extfile", str(d / "san.cnf"), "-out", str(d / f"{name}.pem"))
    port, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    log = open(d / "etcd.log", "wb")  # noqa: SIM115 - the child keeps it
    etcd = subprocess.Popen(["etcd", "--name", "tls", "--data-dir", str(d / "data"), "--listen-client-urls", url,
                             "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"tls=http://127.0.0.1:{peer}", "--cert-file", str(d / "server.pem"),
                             "--key-file", str(d / "server.key"), "--trusted-ca-file", str(d / "ca.pem"),
                             "--client-cert-auth"], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        monkeypatch.setenv("HYBRID_RL_ETCD_CA", str(d / "ca.pem"))
        monkeypatch.setenv("HYBRID_RL_ETCD_CERT", str(d / "client.pem"))
        monkeypatch.setenv("HYBRID_RL_ETCD_KEY", str(d / "client.key"))
        store = Etcd(url, PREFIX, wait_s=30)
        store.put("version", {"v": 2})  # waits for etcd to come up
        assert store.get("version") == {"v": 2}
        monkeypatch.delenv("HYBRID_RL_ETCD_CERT")
        monkeypatch.delenv("HYBRID_RL_ETCD_KEY")
        with pytest.raises(Exception):  # noqa: B017 - no client certificate: the TLS handshake fails
            Etcd(url, PREFIX, wait_s=2).get("version")
        with pytest.raises(ValueError, match="not https"):
            Etcd(f"http://127.0.0.1:{port}", PREFIX, wait_s=2)
    finally:
        etcd.terminate()
        etcd.wait(10)
