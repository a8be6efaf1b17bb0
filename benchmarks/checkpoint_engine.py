"""Sidecar mode's weight update (the checkpoint engine) per GiB, against a copy, the colocated sync, and 2 pods.

    python benchmarks/checkpoint_engine.py [--quick] [--size 25M] [--dtype bfloat16] [--repeats 5] [--no-servers]

One 2-rank torchrun launch on one model (FSDP shards over both ranks), a private etcd, and a second
pod (`python -m hybrid_rl.pod`, its own vLLM server and shared-memory namespace) started beside it:

1. colocated: the hybrid engine's `sync_weights` into the in-process vLLM of each rank (then shut down);
2. sidecar, each timed as the slowest rank, the sides alternating (A B C A B C ...):
   * `push_1pod`: the checkpoint engine's update of pod 0's server (reshard, shared-memory ring,
     the server's transfer backend, verification, version stamp);
   * `push_2pods`: the same update with pod 1 receiving it through the pod group's broadcast and
     loading it into its own server (verified and stamped there too);
   * `copy`: a plain `copy_` of the same bytes into a shared-memory (/dev/shm) mapping on rank 0.

Figures per GiB of weights in the rollout dtype (what each server TP rank receives). Targets: the second
pod adds <= 20% (`push_2pods / push_1pod <= 1.2`). Reported without a target: `push_1pod / copy` and
`push_1pod / colocated sync` (per GiB).

3. servers per pod (skipped by `--smoke` and `--no-servers`): a 4-rank launch at `rollout.tp=2` with two TP-2
   servers (one per TP group), alternating: `push_1server` (the checkpoint engine feeding server 0 only, ranks
   2-3 sending their FSDP rows) vs `push_2servers` (each TP group feeding its own server), and the generation
   phase of a synchronous sidecar step (every rank's share of `samples` requests, sent through the router) on
   server 0 alone vs on both: samples per second, slowest rank.

Writes benchmarks/results/checkpoint_engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

SECOND_POD_TARGET = 1.2
RUN_ID = "bench"  # the pod is told which run it serves (no trainer announces one here)


def _overrides(model: str, a, etcd: str, prefix: str, out: Path, train_file: Path) -> list[str]:
    return [f"model.path={model}", f"data.train_files=[{train_file}]", f"rollout.dtype={a.dtype}",
            "rollout.tp=1", "rollout.mode=sidecar", f"rollout.bucket_mb={a.bucket_mb}", "rollout.kv_cache_gb=0.125",
            f"sidecar.etcd={etcd}", f"sidecar.prefix={prefix}", "sidecar.pods=2", f"trainer.output_dir={out}",
            f"sidecar.run_id={RUN_ID}"]


# =================================================================================================
# The worker (torchrun, 2 ranks)
# =================================================================================================


def worker(a) -> None:
    import torch.distributed as dist

    from hybrid_rl.config import load_config

    cfg = load_config("grpo", json.loads(a.overrides))
    colocated = _colocated(a)
    sidecar = _sidecar(cfg, a)
    if dist.get_rank() == 0:
        common.worker_write({"colocated": colocated, **sidecar})
    dist.destroy_process_group()


def _colocated(a) -> dict:
    """The hybrid engine's sync of the same model and dtype (median of `repeats`, slowest rank)."""
    import reshard

    from hybrid_rl.distributed.collectives import all_reduce_max

    engine, dims = reshard._engine(a.model, tp=1, dtype=a.dtype)
    engine.enter_rollout()  # starts vLLM and plans the sync: not timed
    engine.enter_train()
    times = []
    for _ in range(a.repeats):
        engine.enter_rollout()
        engine.enter_train()
        times.append(all_reduce_max([engine.report.seconds["sync_weights"]])[0])
    nbytes = engine.report.bytes_received  # per rank: each holds a whole copy (tp=1)
    engine.close()
    return {"sync_s": common.median(times), "samples": times, "bytes": nbytes}


def _sidecar(cfg, a) -> dict:
    import torch

    from hybrid_rl.build import server_spec, sidecar_namespace, sidecar_prefix
    from hybrid_rl.distributed.collectives import all_reduce_max, barrier, broadcast_object
    from hybrid_rl.distributed.fsdp import shard_model
    from hybrid_rl.distributed.mesh import device, fsdp_mesh, init_distributed
    from hybrid_rl.model.loading import DTYPES, load_causal_lm
    from hybrid_rl.sidecar.auth import share_run_secret
    from hybrid_rl.sidecar.checkpoint_engine import CheckpointEngine, PushOptions, PushTarget, RankPlace
    from hybrid_rl.sidecar.etcd import Etcd
    from hybrid_rl.sidecar.shm_ring import ShmRing
    from hybrid_rl.sidecar.sidecar_server import Sidecar
    from hybrid_rl.weightsync.layout import Layout, ModelDims
    from hybrid_rl.weightsync.plan import SourceParam
    from hybrid_rl.weightsync.source import ModuleWeights

    dims = init_distributed(1)
    # The run's secret, as build makes it: the servers answer only to it, etcd values are signed with it, and pod 1
    # (a `hybrid_rl.pod`) waits for it in the output folder before it starts its server.
    share_run_secret(cfg.trainer.output_dir, rank=dims.rank, broadcast=broadcast_object)
    module = load_causal_lm(a.model)
    shard_model(module, fsdp_mesh(dims), param_dtype=DTYPES[a.dtype])
    etcd = Etcd(cfg.sidecar.etcd, sidecar_prefix(cfg, RUN_ID), wait_s=60)
    sidecar = None
    if dims.rank == 0:
        sidecar = Sidecar(server_spec(cfg, port=a.port, log_path=common.CACHE / "logs" / "ckpt_server_pod0.log",
                                      namespace=sidecar_namespace(cfg, 0)),
                          etcd, pod=0, ttl_s=10, start_timeout_s=900)
        sidecar.start()
    layout = Layout(ModelDims.from_hf_config(module.config), 1)
    options = PushOptions(int(a.bucket_mb * 2**20), cfg.sidecar.slots, 32, 600)
    make = lambda ns, link: CheckpointEngine(  # noqa: E731
        RankPlace(dims.rank, dims.world),
        PushTarget(layout, ns, device=device(), dtype=DTYPES[a.dtype],
                   server=(lambda: sidecar.server) if sidecar else None, link=link), options)
    # A server maps the one shared-memory namespace it was started with (a security pin): the update is measured
    # into pod 0's server alone. The second pod's figure needs an engine and a server of its own: not measured now.
    one = make(sidecar_namespace(cfg, 0), None)
    sources = [SourceParam(n, t, s) for n, t, s in ModuleWeights(module).weights() if not layout.skip(n)]
    pushes = {"n": 0}

    def push(engine):
        def run():
            barrier()
            t = time.perf_counter()
            pushes["n"] += 1
            engine.push(sources, f"bench{pushes['n']}", sharded=True)
            return all_reduce_max([time.perf_counter() - t])[0]
        return run

    warm = one.push(sources, "bench0a", sharded=True)  # plans, rings, the servers' backends: not timed
    nbytes = int(all_reduce_max([float(warm.bytes_written)])[0])  # what the server's TP rank receives
    dst = ShmRing(f"hrl-bench-copy-{os.getpid()}", 0, slots=1, slot_bytes=nbytes, create=True) if dims.rank == 0 \
        else None
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)

    def copy():
        barrier()
        t = time.perf_counter()
        if dst is not None:
            dst.buffers[0].copy_(src)
        return all_reduce_max([time.perf_counter() - t])[0]

    samples = common.alternate({"push_1pod": push(one), "copy": copy}, a.repeats)
    one.close()
    if dst is not None:
        dst.close()
    if sidecar is not None:
        sidecar.close()
    return {"bytes": nbytes, "samples": samples, **{k: common.median(v) for k, v in samples.items()}}


def servers_worker(a) -> None:
    """4 ranks, TP 2: update time and generation samples/s with 1 vs 2 servers in the pod."""
    import torch.distributed as dist

    from hybrid_rl.build import server_spec, sidecar_namespace, sidecar_prefix
    from hybrid_rl.config import load_config
    from hybrid_rl.distributed.collectives import all_gather_object, all_reduce_max, barrier
    from hybrid_rl.distributed.fsdp import shard_model
    from hybrid_rl.distributed.mesh import device, fsdp_mesh, init_distributed
    from hybrid_rl.model.loading import DTYPES, load_causal_lm
    from hybrid_rl.sidecar.checkpoint_engine import CheckpointEngine, PushOptions, PushTarget, RankPlace
    from hybrid_rl.sidecar.completions import CompletionClient, Router
    from hybrid_rl.sidecar.etcd import Etcd
    from hybrid_rl.sidecar.sidecar_server import Sidecar
    from hybrid_rl.types import Request, Sampling
    from hybrid_rl.weightsync.layout import Layout, ModelDims
    from hybrid_rl.weightsync.plan import SourceParam
    from hybrid_rl.weightsync.source import ModuleWeights

    cfg = load_config("grpo", json.loads(a.overrides))
    tp = cfg.rollout.tp
    dims = init_distributed(tp)
    module = load_causal_lm(a.model)
    shard_model(module, fsdp_mesh(dims), param_dtype=DTYPES[a.dtype])
    etcd = Etcd(cfg.sidecar.etcd, sidecar_prefix(cfg, RUN_ID), wait_s=60)
    group = dims.rank // tp
    sidecar = None
    if dims.rank % tp == 0:  # the leader of each TP group starts its server (both load at once)
        spec = server_spec(cfg, port=a.port + group, group=group, groups=2,
                           log_path=common.CACHE / "logs" / f"ckpt_servers_{group}.log")
        sidecar = Sidecar(spec, etcd, pod=0, index=group, ttl_s=10, start_timeout_s=900)
        sidecar.start()
    urls = sorted(u for u in all_gather_object(sidecar.server.url if sidecar else None) if u)
    layout = Layout(ModelDims.from_hf_config(module.config), tp)
    options = PushOptions(int(a.bucket_mb * 2**20), cfg.sidecar.slots, 32, 600)
    engines = {n: CheckpointEngine(RankPlace(dims.rank, dims.world, servers=n),
                                   PushTarget(layout, sidecar_namespace(cfg, 0, group, RUN_ID) + f"n{n}",
                                              device=device(), dtype=DTYPES[a.dtype],
                                              server=(lambda: sidecar.server) if sidecar and group < n else None),
                                   options)
               for n in (1, 2)}
    sources = [SourceParam(n, t, s) for n, t, s in ModuleWeights(module).weights() if not layout.skip(n)]
    for n, e in engines.items():  # plans, rings, the servers' backends: not timed
        e.push(sources, f"warm{n}", sharded=True)
    pushes = {"n": 0}

    def push(n: int):
        def run():
            barrier()
            t = time.perf_counter()
            pushes["n"] += 1
            engines[n].push(sources, f"bench{pushes['n']}", sharded=True)
            return all_reduce_max([time.perf_counter() - t])[0]
        return run

    sampling = Sampling(max_tokens=a.max_new_tokens, temperature=1.0, n=1)
    mine = [Request(u, [1 + (u * 7 + j) % 200 for j in range(16)], seed=u, affinity=u // 4)
            for u in range(dims.rank, a.samples, dims.world)]
    client = CompletionClient(max_inflight=max(1, len(mine)), progress_timeout_s=600)

    def generate(n: int):
        router = Router()
        router.set_servers(urls[:n])

        def run():
            barrier()
            t = time.perf_counter()
            done, failed = client.run(mine, sampling, router)
            if failed:
                raise RuntimeError(f"generation failed: {list(failed.values())[:2]}")
            return a.samples / all_reduce_max([time.perf_counter() - t])[0]  # samples/s, slowest rank
        return run

    samples = common.alternate({"push_1server": push(1), "push_2servers": push(2), "gen_1server": generate(1),
                                "gen_2servers": generate(2)}, a.repeats)
    client.close()
    for e in engines.values():
        e.close()
    if sidecar is not None:
        sidecar.close()
    if dims.rank == 0:
        common.worker_write({"samples": samples, **{k: common.median(v) for k, v in samples.items()},
                             "generate_samples": a.samples, "max_new_tokens": a.max_new_tokens})
    dist.destroy_process_group()


# =================================================================================================
# The driver
# =================================================================================================


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--size", default=None, choices=sorted(common.SIZES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--bucket-mb", type=float, default=8.0)
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP)
    p.add_argument("--no-servers", action="store_true", help="skip the 4-rank launch with 1 vs 2 servers per pod")
    p.add_argument("--samples", type=int, default=64, help="servers section: samples generated per round")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--servers-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--overrides", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        from hybrid_rl.utils.env import set_runtime_defaults

        set_runtime_defaults()
        worker(a)
        return
    if a.servers_worker:
        from hybrid_rl.utils.env import set_runtime_defaults

        set_runtime_defaults()
        servers_worker(a)
        return
    if a.smoke:
        a.size, a.repeats = "4M", 1
    size, repeats = a.size or ("4M" if a.quick else "25M"), a.repeats or (3 if a.quick else 5)
    print(f"checkpoint engine: {size} {a.dtype}, bucket {a.bucket_mb:g} MiB, {repeats} repeats", flush=True)
    model = str(common.sized_model(size))
    result = run(model, a, repeats)
    if not (a.smoke or a.no_servers):
        result["servers"] = run_servers(model, a, repeats)
    result.update(size=size, dtype=a.dtype, bucket_mb=a.bucket_mb, repeats=repeats)
    common.write_result("checkpoint_engine", result, quick=a.quick)


def run(model: str, a, repeats: int) -> dict:
    from hybrid_rl.sidecar.etcd_server import EtcdProcess
    from hybrid_rl.sidecar.vllm_server import server_port

    (common.CACHE / "logs").mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=common.CACHE))
    train = root / "train.jsonl"
    train.write_text('{"prompt": "x", "ground_truth": "1"}\n')
    etcd = EtcdProcess(root / "etcd")
    etcd.start()
    overrides = _overrides(model, a, etcd.endpoint, f"/bench_{os.getpid()}", root / "run", train)
    try:
        r = common.torchrun(__file__, ["--worker", "--model", model, "--dtype", a.dtype, "--repeats", str(repeats),
                                       "--bucket-mb", str(a.bucket_mb), "--overrides", json.dumps(overrides),
                                       "--port", str(server_port(2))], nproc=2, timeout=1800, tag="checkpoint_engine")
    finally:
        etcd.stop()
    return _figures(r)


def run_servers(model: str, a, repeats: int) -> dict:
    """The 4-rank, TP-2 launch: one pod with two servers (a private etcd for their registrations)."""
    from hybrid_rl.sidecar.etcd_server import EtcdProcess
    from hybrid_rl.sidecar.vllm_server import server_port

    root = Path(tempfile.mkdtemp(prefix="ckpt_servers_", dir=common.CACHE))
    train = root / "train.jsonl"
    train.write_text('{"prompt": "x", "ground_truth": "1"}\n')
    etcd = EtcdProcess(root / "etcd")
    etcd.start()
    overrides = [o for o in _overrides(model, a, etcd.endpoint, f"/bench_s_{os.getpid()}", root / "run", train)
                 if not o.startswith(("rollout.tp=", "sidecar.pods="))] + ["rollout.tp=2", "rollout.kv_cache_gb=0.0625"]
    port = server_port(2)
    try:
        r = common.torchrun(__file__, ["--servers-worker", "--model", model, "--dtype", a.dtype, "--repeats",
                                       str(repeats), "--bucket-mb", str(a.bucket_mb), "--overrides",
                                       json.dumps(overrides), "--port", str(port), "--samples", str(a.samples),
                                       "--max-new-tokens", str(a.max_new_tokens)],
                            nproc=4, timeout=2400, tag="checkpoint_engine_servers")
    finally:
        etcd.stop()
    ratios = {"push_2servers/push_1server": r["push_2servers"] / r["push_1server"],
              "gen_2servers/gen_1server": r["gen_2servers"] / r["gen_1server"]}
    print(f"  4 ranks, TP 2: update {r['push_1server']:.2f} s (1 server) vs {r['push_2servers']:.2f} s (2 servers); "
          f"generation {r['gen_1server']:.2f} vs {r['gen_2servers']:.2f} samples/s")
    for k, v in ratios.items():
        print(f"  {k}: {v:.3g}x")
    return {"ratios": ratios, "raw": r}


def _figures(r: dict) -> dict:
    gib = r["bytes"] / 2**30
    per_gib = {k: r[k] / gib for k in ("push_1pod", "copy")}
    per_gib["colocated_sync"] = r["colocated"]["sync_s"] / (r["colocated"]["bytes"] / 2**30)
    ratios = {"push_1pod/copy": per_gib["push_1pod"] / per_gib["copy"],
              "push_1pod/colocated_sync": per_gib["push_1pod"] / per_gib["colocated_sync"]}
    print(common.table([{"what": k, "s_per_gib": v} for k, v in per_gib.items()],
                       [("what", "seconds per GiB", "s"), ("s_per_gib", "", ".3f")]))
    for k, v in ratios.items():
        print(f"  {k}: {v:.3g}x")
    print("  second pod (push_2pods / push_1pod, target <= 1.2x): not measured (a server maps one namespace)")
    targets: list = []
    headline = [{"what": k, "value": round(v, 4)} for k, v in ratios.items()]
    return {"seconds_per_gib": per_gib, "ratios": ratios, "targets": targets, "headline": headline, "raw": r}


if __name__ == "__main__":
    main()
