"""Sidecar mode's start-up checks and etcd coordination, without a vLLM server (seconds each).

* bad configuration fails before any weight is loaded, with one message naming the key (exit code 2);
* the etcd layer against a real etcd: leases keep a registration, a restarted etcd keeps it (or it is
  written again), an etcd that stays away ends in one error naming the endpoint after `wait_s`.
"""

import socket
import subprocess
import sys
import time

import pytest

from hybrid_rl.build import check_inputs
from hybrid_rl.config import ConfigError, load_config
from hybrid_rl.distributed.mesh import free_port
from hybrid_rl.sidecar.etcd import Etcd, EtcdUnavailable, Registration
from hybrid_rl.sidecar.etcd_server import EtcdProcess
from tests.conftest import REPO, TIMING

pytestmark = [pytest.mark.slow, TIMING]  # leases of 3 s kept alive across an etcd restart


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    proc = EtcdProcess(tmp_path_factory.mktemp("etcd") / "data")
    proc.start()
    yield proc
    proc.stop()


def _train(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybrid_rl.train", "--config-name=grpo", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_bad_sidecar_configuration_fails_before_heavy_work(tiny_models, task_files, etcd, tmp_path, monkeypatch):
    """`check_inputs` (what `hybrid_rl.train` runs before loading anything) names the key of each bad setting;
    through the command line it is one `error:` line and exit code 2."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    base = [f"model.path={tiny_models['qwen2']}", f"data.train_files=[{task_files['train']}]",
            f"trainer.output_dir={tmp_path}", "reward.num_workers=0", "rollout.mode=sidecar",
            f"sidecar.etcd={etcd.endpoint}", f"sidecar.port={free_port()}"]
    cases = {  # overrides, trainer ranks on the pod, the message
        "no server binary": (["sidecar.python=/nonexistent/python"], 1, "sidecar.python='/nonexistent/python'"),
        "port taken": ([f"sidecar.port={taken.getsockname()[1]}"], 1, f"sidecar.port={taken.getsockname()[1]}"),
        "TP that does not divide the heads": (["rollout.tp=3"], 4, "rollout.tp=3 does not fit the model: "
                                              "rollout.tp=3 must divide"),
        "TP larger than the pod": (["rollout.tp=2"], 1, "at most the trainer ranks of its pod (1)"),
        "etcd unreachable": ([f"sidecar.etcd=http://127.0.0.1:{free_port()}"], 1, "is unreachable"),
        "rings larger than /dev/shm": (["rollout.bucket_mb=100000000"], 1, "of shared memory in /dev/shm"),
        "no etcd for two pods": (["sidecar.etcd=''", "sidecar.pods=2"], 1, "a private etcd serves one pod"),
    }
    try:
        for case, (overrides, ranks, expected) in cases.items():
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
            with pytest.raises(ConfigError) as e:
                check_inputs(load_config("grpo", base + overrides), ranks)
            assert expected in str(e.value), (case, str(e.value))
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        t0 = time.monotonic()
        r = _train(*base, "sidecar.python=/nonexistent/python")
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert r.returncode == 2 and len(errors) == 1 and "sidecar.python=" in errors[0], r.stderr[-2000:]
        assert "Traceback" not in r.stderr and time.monotonic() - t0 < 120
    finally:
        taken.close()


def test_etcd_registration_survives_an_etcd_restart_and_an_outage_ends_in_one_error(etcd):
    store = Etcd(etcd.endpoint, "/test_reg", wait_s=30)
    store.check()
    reg = Registration(store, "servers/pod0", {"url": "http://a", "version": None}, ttl_s=3)
    try:
        reg.update({"url": "http://a", "version": "v1"})
        assert store.get_prefix("servers") == {"pod0": {"url": "http://a", "version": "v1"}}
        etcd.stop()
        time.sleep(4)  # longer than the lease's TTL: the lease is granted again when etcd is back
        etcd.start()
        assert store.get("servers/pod0") is not None  # this call waited for etcd (it was back) and found it
        time.sleep(4)  # a full TTL later the key is still there: the keep-alive runs on the restarted etcd
        assert store.get_prefix("servers") == {"pod0": {"url": "http://a", "version": "v1"}}
    finally:
        reg.close()
    assert store.get_prefix("servers") == {}, "closing revokes the lease: the key goes at once"
    etcd.stop()
    try:
        with pytest.raises(EtcdUnavailable, match=f"etcd at {etcd.endpoint} unreachable for 2 s"):
            Etcd(etcd.endpoint, "/test_reg", wait_s=2).get("version")
        with pytest.raises(EtcdUnavailable, match=f"etcd at {etcd.endpoint} .*is unreachable"):
            Etcd(etcd.endpoint, "/test_reg", wait_s=60).check()  # start-up: no wait
    finally:
        etcd.start()


def test_two_runs_with_the_same_folder_name_on_one_etcd_stay_apart(etcd, tmp_path):
    """Each run has its own id (kept in its output folder: a resume is the same run) in every key and weight
    version: run A never lists run B's server, even at B's version number; a pod must be told which run to serve."""
    from hybrid_rl.build import sidecar_namespace, sidecar_prefix, sidecar_run_id
    from hybrid_rl.distributed.mesh import ParallelDims
    from hybrid_rl.pod import _live_run
    from hybrid_rl.sidecar.versions import servers_at

    dims = ParallelDims(1, 0, 0, 1)
    cfgs = [load_config("grpo", ["model.path=/m", "data.train_files=[/t.jsonl]", f"sidecar.etcd={etcd.endpoint}",
                                 f"trainer.output_dir={tmp_path / side / 'run'}"])
            for side in ("a", "b")]
    ids = [sidecar_run_id(c, dims) for c in cfgs]
    assert ids[0] != ids[1] and sidecar_run_id(cfgs[0], dims) == ids[0], "unique, and the same on resume"
    assert sidecar_prefix(cfgs[0]) == sidecar_prefix(cfgs[1]), "the same folder name"
    assert sidecar_prefix(cfgs[0], ids[0]) != sidecar_prefix(cfgs[1], ids[1])
    assert sidecar_namespace(cfgs[0], 0, run_id=ids[0]) != sidecar_namespace(cfgs[1], 0, run_id=ids[1])
    stores = [Etcd(etcd.endpoint, sidecar_prefix(c, i), wait_s=5) for c, i in zip(cfgs, ids, strict=True)]
    regs = [Registration(s, "servers/pod0", {"url": f"http://{i}", "version": f"{i}-v1"}, ttl_s=5)
            for s, i in zip(stores, ids, strict=True)]
    base = Etcd(etcd.endpoint, sidecar_prefix(cfgs[0]), wait_s=5)
    announced = [Registration(base, f"runs/{i}", {"run": i}, ttl_s=5) for i in ids]
    try:
        assert servers_at(stores[0], f"{ids[0]}-v1") == [f"http://{ids[0]}"]
        assert servers_at(stores[0], f"{ids[1]}-v1") == []  # B's version is not A's, and B's keys are elsewhere
        with pytest.raises(RuntimeError, match="sidecar.run_id"):
            _live_run(base, wait_s=1)
        announced.pop().close()
        assert _live_run(base, wait_s=1) == ids[0]
    finally:
        for r in regs + announced:
            r.close()
