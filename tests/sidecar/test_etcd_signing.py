"""Values in etcd are believed only when signed with the run's key (a real etcd, written to by a stranger: raw
unsigned JSON, and values signed with another key)."""

import json
import secrets

import pytest

from hybrid_rl.pod import _wait_for
from hybrid_rl.sidecar.auth import etcd_key
from hybrid_rl.sidecar.etcd import Etcd, Registration
from hybrid_rl.sidecar.etcd_server import EtcdProcess
from hybrid_rl.sidecar.pod_link import GROUP_KEY
from hybrid_rl.sidecar.rollout import servers_at

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
