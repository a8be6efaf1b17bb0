"""Asynchronous training (`rollout.max_staleness` = k) against synchronous sidecar mode and colocated.

    python benchmarks/async.py [--quick] [--steps 8] [--skip 2] [--rounds 3] [--prompts 32]
                               [--configs colocated k0 k1 k2] [--poll-s 0.05] [--no-server-poll]

One run launches, on the same model, data and seed, `torchrun --nproc_per_node=2 -m hybrid_rl.train
--config-name=grpo` on the demo's workload (`hybrid_rl.demo`: its tiny warmed-up model, its task and settings;
validation off) in four configurations, in turn, `--rounds` times (A B C D A B C D ...):

* `colocated`: the hybrid engine (vLLM in every trainer rank);
* `k0`: sidecar mode, synchronous (a vLLM server beside the trainer, started by it);
* `k1`, `k2`: sidecar mode, asynchronous with `rollout.max_staleness` 1 and 2.

One private etcd serves the sidecar runs. The first `--skip` steps of each launch (server start, first sync,
filling the buffer) are not counted; the figures come from the trainer's metrics.jsonl over the other steps of
all rounds, and from what this process sees while they run:

* samples/s = samples trained / step seconds, summed over the measured steps (a throughput: a sum, not a
  median, as async steps alternate long and short); tokens/s the same with prompt + response tokens ("trained
  tokens": what the update runs on) and with response tokens alone;
* trainer waits (share of step time): for generation in colocated and k0 (`timing/rollout_s` less the
  weight sync and the mode switch), for the experience buffer in k1/k2 (`async/wait_s`);
* server idle (share of the measured steps' wall time): the server's Prometheus endpoint polled every 50 ms,
  idle when `vllm:num_requests_running` + `vllm:num_requests_waiting` == 0, and beside it the share of
  intervals in which `vllm:prompt_tokens_total` + `vllm:generation_tokens_total` did not grow: the first
  misses requests shorter than a poll gap, the second counts a gap busy for one token, the truth lies
  between. Colocated: the engine runs only in the rollout phase, so idle = 1 - rollout share, by construction;
* CPU: cores used by all the launch's processes (CPU seconds / wall seconds, psutil, same polls), by the vLLM
  server's processes, and by the server while idle by both tests (what it takes from the trainer).

Ratios of samples/s against k0 and against colocated, measured in this run on this machine. No target: the
figures are what they are. `simulate()` adds a model -- not a measurement -- of what asynchrony gives on GPUs,
where generation and training run on hardware that would otherwise idle. Writes benchmarks/results/async.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

CONFIGS = {"colocated": None, "k0": 0, "k1": 1, "k2": 2}  # name -> max_staleness (None: colocated)
POLL_S = 0.05  # --poll-s
RUN_TIMEOUT_S = 1200
N = 8  # samples per prompt: the demo's rollout.n (checked at each launch)


# =================================================================================================
# Polling the server and the metrics file while a run goes on
# =================================================================================================


@dataclass
class Poll:
    t: float
    tree_cpu_s: float | None = None  # CPU seconds so far of the launch's processes (server included)
    server_cpu_s: float | None = None  # ... of the vLLM server's processes (API server, engine core, worker)
    self_cpu_s: float | None = None  # ... of this process (the polling itself)
    running: float | None = None
    waiting: float | None = None
    tokens: float | None = None  # prompt + generation tokens so far (counters)


@dataclass
class Watch:
    """What the parent sees of a run: the CPU time of its processes, the server's counters and gauges, and when
    each step's record appeared."""

    root_pid: int
    port: int | None  # None: the server is not polled (colocated, or --poll-s 0)
    metrics: Path
    every_s: float
    polls: list[Poll] = field(default_factory=list)
    step_seen: dict[int, float] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def loop(self) -> None:
        import requests

        session, offset, url = requests.Session(), 0, f"http://127.0.0.1:{self.port}/metrics"
        tree = Tree(self.root_pid)
        while not self.stop.is_set():
            t = time.monotonic()
            offset = self._records(offset, t)
            poll = Poll(t, *tree.cpu(), self_cpu_s=time.process_time())
            if self.port is not None:
                try:
                    _parse(session.get(url, timeout=1).text, poll)
                except requests.RequestException:
                    pass  # not up yet, or gone
            self.polls.append(poll)
            self.stop.wait(max(0.0, self.every_s - (time.monotonic() - t)))

    def _records(self, offset: int, t: float) -> int:
        try:
            with open(self.metrics) as f:
                f.seek(offset)
                text = f.read()
        except OSError:
            return offset
        done = text[: text.rfind("\n") + 1]
        for line in done.splitlines():
            step = json.loads(line).get("step")
            if step is not None:
                self.step_seen.setdefault(step, t)
        return offset + len(done)


class Tree:
    """The launch's processes (re-listed every 2 s: the server starts after the trainer) and their CPU time."""

    def __init__(self, root_pid: int):
        self.root_pid, self.listed, self.procs, self.server = root_pid, -1e9, [], set()

    def cpu(self) -> tuple[float | None, float | None]:
        """CPU seconds (user + system) of the whole tree, and of its vLLM server's processes."""
        import psutil

        if time.monotonic() - self.listed > 2.0:
            self._list()
        tree = server = 0.0
        for proc in self.procs:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            tree += times.user + times.system
            server += (times.user + times.system) if proc.pid in self.server else 0.0
        return (tree if self.procs else None), (server if self.server else None)

    def _list(self) -> None:
        import psutil

        self.listed = time.monotonic()
        try:
            root = psutil.Process(self.root_pid)
            self.procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        server = set()
        for proc in self.procs:  # the API server, and under it the engine core and its worker (started later)
            try:
                if "vllm.entrypoints" in " ".join(proc.cmdline()):
                    server |= {proc.pid, *(c.pid for c in proc.children(recursive=True))}
            except psutil.NoSuchProcess:
                continue
        self.server = server


_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$")


def _parse(text: str, poll: Poll) -> None:
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if m := _SAMPLE.match(line):
            sums[m[1]] = sums.get(m[1], 0.0) + float(m[2])
    if "vllm:generation_tokens_total" in sums:
        poll.tokens = sums["vllm:generation_tokens_total"] + sums.get("vllm:prompt_tokens_total", 0.0)
    poll.running, poll.waiting = sums.get("vllm:num_requests_running"), sums.get("vllm:num_requests_waiting")


def window(polls: list[Poll], t0: float, t1: float) -> dict:
    """What the polls say of [t0, t1] (the measured steps): CPU cores the launch used (all its processes, and
    the server's); with the server polled, the share of the time it was idle by two tests that bracket the
    truth -- no request running or waiting at the poll (gauges: a request shorter than a poll gap goes unseen)
    and no token counted since the last poll (counters: one token makes the whole gap busy) -- and the cores
    its processes used while idle by both tests."""
    inside = [p for p in polls if t0 <= p.t <= t1]
    pairs = list(zip(inside, inside[1:], strict=False))
    out: dict = {"polls": len(inside), "span_s": sum(b.t - a.t for a, b in pairs)}
    if not pairs:
        return out
    out["poll_gap_median_s"] = common.median([b.t - a.t for a, b in pairs])

    def cores(key: str, chosen) -> float | None:
        got = [(getattr(b, key) - getattr(a, key), b.t - a.t) for a, b in chosen
               if getattr(a, key) is not None and getattr(b, key) is not None]
        wall = sum(w for _, w in got)
        return sum(c for c, _ in got) / wall if wall > 0 else None

    out["run_cores"], out["server_cores"] = cores("tree_cpu_s", pairs), cores("server_cpu_s", pairs)
    out["poller_cores"] = cores("self_cpu_s", pairs)
    served = [(a, b) for a, b in pairs if a.tokens is not None and b.tokens is not None]
    span = sum(b.t - a.t for a, b in served)
    if span <= 0:
        return out
    no_request = [(a, b) for a, b in served if not (b.running or 0) and not (b.waiting or 0)]
    no_token = [(a, b) for a, b in served if b.tokens <= a.tokens]
    out["idle_gauges"] = sum(b.t - a.t for a, b in no_request) / span
    out["idle_tokens"] = sum(b.t - a.t for a, b in no_token) / span
    idle = [x for x in no_token if x in no_request]  # idle by both tests
    out["server_cores_idle"] = cores("server_cpu_s", idle)
    out["server_cores_busy"] = cores("server_cpu_s", [x for x in served if x not in idle])
    return out


# =================================================================================================
# One configuration
# =================================================================================================


@dataclass
class Run:
    """One launch of one configuration: its measured steps' records and what the parent saw of its server."""

    records: list[dict]
    seen: dict  # window() over the measured steps
    wall_s: float  # the whole launch, start-up included
    load_avg: tuple[float, float]  # the 1-minute load average at the launch's start and end


def run_config(name: str, k: int | None, *, out: Path, warm: Path, data: Path, a, etcd) -> Run:
    from hybrid_rl.demo.__main__ import demo_overrides, sidecar_overrides
    from hybrid_rl.metrics.jsonl import read_records

    shutil.rmtree(out, ignore_errors=True)
    overrides = [o for o in demo_overrides(model=warm, data=data, out=out, steps=a.steps, prompts=a.prompts,
                                           val_every=0) if not o.startswith(("data.val_files=", "data.val_prompts="))]
    overrides += ["trainer.show_progress=false", "trainer.export=false", f"trainer.save_every={10 * a.steps}"]
    if f"rollout.n={N}" not in overrides:
        raise RuntimeError(f"the demo's settings no longer have rollout.n={N}; update N in {Path(__file__).name}")
    port = None
    if k is not None:
        side = sidecar_overrides(etcd=etcd.endpoint, max_staleness=k)
        port = int(next(o.split("=", 1)[1] for o in side if o.startswith("sidecar.port=")))
        overrides += side + [f"sidecar.prefix=/async_bench_{os.getpid()}_{out.name}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "hybrid_rl.train", "--config-name=grpo", *overrides]
    log = common.CACHE / "logs" / f"async_{out.name}.log"
    t_start, load0 = time.monotonic(), os.getloadavg()[0]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=common.REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        watch = Watch(proc.pid, None if a.no_server_poll else port, out / "metrics.jsonl", a.poll_s)
        poller = threading.Thread(target=watch.loop, daemon=True)
        poller.start()
        try:
            rc = proc.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun, its ranks and the server they started
            rc = proc.wait()
        finally:
            watch.stop.set()
            poller.join()
    wall = time.monotonic() - t_start
    (out / "server_polls.json").write_text(json.dumps({"steps_seen": watch.step_seen,
                                                       "polls": [vars(p) for p in watch.polls]}))
    if rc != 0:
        print("\n".join(log.read_text().splitlines()[-40:]), file=sys.stderr)
        raise RuntimeError(f"{out.name}: training failed (exit {rc}); full output: {log}")
    records = [r for r in read_records(out / "metrics.jsonl") if "timing/step_s" in r and r["step"] > a.skip]
    t0, t1 = watch.step_seen.get(a.skip), watch.step_seen.get(a.steps)
    seen = window(watch.polls, t0, t1) if t0 is not None and t1 is not None else {}
    return Run(records, seen, wall, (load0, os.getloadavg()[0]))


def summarize(name: str, k: int | None, runs: list[Run], a) -> dict:
    """One configuration's figures over the measured steps of all its launches (rounds)."""
    measured = [r for run in runs for r in run.records]
    samples = a.prompts * N  # no dynamic sampling in the demo: every step trains them all
    step_s = [r["timing/step_s"] for r in measured]
    total_s = sum(step_s)
    tokens = [r["throughput/tokens_per_s"] * r["timing/step_s"] for r in measured]  # prompt + response
    response = [r["response/length_mean"] * samples for r in measured]
    t = lambda r, key: r.get(f"timing/{key}_s") or 0.0  # noqa: E731
    if k:  # asynchronous: the trainer waits only for the buffer
        wait = [r.get("async/wait_s", 0.0) for r in measured]
    else:  # for generation: the rollout phase less the weight sync and the mode switch
        wait = [t(r, "rollout") - t(r, "sync") - t(r, "switch") for r in measured]
    s = {
        "name": name, "max_staleness": k, "rounds": len(runs), "steps_measured": len(measured),
        "launch_wall_s": [run.wall_s for run in runs], "launch_load_avg": [run.load_avg for run in runs],
        "step_s_median": common.median(step_s), "step_s": step_s,
        "samples_per_s": samples * len(measured) / total_s,
        "samples_per_s_by_round": [samples * len(run.records) / sum(r["timing/step_s"] for r in run.records)
                                   for run in runs],
        "trained_tokens_per_s": sum(tokens) / total_s, "response_tokens_per_s": sum(response) / total_s,
        "trainer_wait_share": sum(wait) / total_s,
        "sync_share": sum(t(r, "sync") + t(r, "switch") for r in measured) / total_s,
        "update_share": sum(t(r, "update") for r in measured) / total_s,
        "response_length_mean": common.median([r["response/length_mean"] for r in measured]),
        "reward_mean": common.median([r.get("reward/mean") or 0.0 for r in measured]),
    }
    if k:
        s["staleness_groups_mean"] = common.median([r.get("async/staleness_groups_mean", 0.0) for r in measured])
    seen = [run.seen for run in runs if run.seen.get("span_s")]

    def avg(key: str) -> float | None:  # over the launches, weighted by their measured wall time
        got = [(x[key], x["span_s"]) for x in seen if x.get(key) is not None]
        return sum(v * w for v, w in got) / sum(w for _, w in got) if got else None

    s["run_cores"], s["poller_cores"] = avg("run_cores"), avg("poller_cores")
    if k is None:  # colocated: the engine exists only in the rollout phase
        s["server_idle_share"] = 1 - sum(t(r, "rollout") for r in measured) / total_s
        s["server_idle_how"] = "1 - rollout share of the step (colocated: by construction)"
        return s
    s["server_idle_share"], s["server_idle_tokens_share"] = avg("idle_gauges"), avg("idle_tokens")
    s["server_cores"], s["server_cores_idle"], s["server_cores_busy"] = (
        avg("server_cores"), avg("server_cores_idle"), avg("server_cores_busy"))
    s["server_polls"] = sum(x["polls"] for x in seen)
    s["server_idle_how"] = (f"polled /metrics every {a.poll_s * 1000:.0f} ms over the measured steps: share of the "
                            "time with vllm:num_requests_running + vllm:num_requests_waiting == 0 at the polls "
                            "(tokens: share of intervals in which no prompt or generation token was counted); the "
                            "first misses requests shorter than a poll gap, the second counts a gap busy for one "
                            "token: the true share lies between")
    return s


# =================================================================================================
# A model of the same comparison on GPUs (not a measurement)
# =================================================================================================


def simulate(*, batch: int = 256, steps: int = 400, sync_over_train: float = 0.05, seed: int = 0) -> list[dict]:
    """Mean step time of synchronous vs asynchronous training in a model of GPU servers; speedups over a grid.

    Per step a batch of `batch` response lengths L ~ lognormal(median 1, sigma), clipped at 16 x the median
    (max_new_tokens). Decode is memory-bound: one decode step costs t_tok whatever the number of requests in
    it, so a request of length L takes L * t_tok. T = train time, S = weight update (S = `sync_over_train` x T).

    * synchronous (k = 0): every request of the batch starts at once, the step waits for the longest:
      R = t_tok * max(L); step = R + S + T; the servers idle during S + T and the trainer during R; the
      servers also run below capacity in the tail.
    * asynchronous (k >= 1, partial rollouts, the same number of requests in flight): a finished request's
      slot takes the next one at once, so the servers produce a batch's worth in t_tok * mean(L); but a
      request started at version v must be trained by version v + k, so the step can be no shorter than
      t_tok * max(L) / (k + 1). step = max(t_tok * max(mean(L), max(L) / (k + 1)), T) + S (the servers pause
      during the update; partial rollouts keep their requests).

    The grid: R/T = E[t_tok * max(L)] / T (how rollout-dominated a synchronous step is) and sigma (how long the
    tail is; 0 = every response the same length). Returns one row per (R/T, sigma, k) with the speedup of
    samples/s over k = 0 and each side's idle share.
    """
    rng = random.Random(seed)
    rows = []
    for sigma in (0.0, 0.5, 1.0):
        batches = [[min(16.0, math.exp(rng.gauss(0.0, sigma))) for _ in range(batch)] for _ in range(steps)]
        mean_max = sum(max(b) for b in batches) / steps
        for r_over_t in (0.25, 0.5, 1.0, 2.0, 4.0):
            t_train, s = 1.0, sync_over_train
            t_tok = r_over_t * t_train / mean_max
            sync = [t_tok * max(b) + s + t_train for b in batches]
            base = sum(sync) / steps
            busy = sum(t_tok * sum(b) / batch for b in batches) / steps  # the servers' work: slot-time / slots
            rows.append({"r_over_t": r_over_t, "sigma": sigma, "k": 0, "step": base, "speedup": 1.0,
                         "trainer_idle": sum(t_tok * max(b) for b in batches) / steps / base,
                         "server_idle": 1 - busy / base})
            for k in (1, 2):
                gen = [t_tok * max(sum(b) / batch, max(b) / (k + 1)) for b in batches]
                step = [max(g, t_train) + s for g in gen]
                mean = sum(step) / steps
                rows.append({"r_over_t": r_over_t, "sigma": sigma, "k": k, "step": mean, "speedup": base / mean,
                             "trainer_idle": sum(max(g, t_train) - t_train for g in gen) / steps / mean,
                             "server_idle": 1 - busy / mean})
    return rows


def print_simulation(rows: list[dict]) -> None:
    print("\nMODEL, not a measurement: samples/s of async k over synchronous (k = 0) on GPU servers; S = 0.05 T")
    sigmas = sorted({r["sigma"] for r in rows})
    header = "R/T   " + "  ".join(f"sigma {s:g}: k=1  k=2" for s in sigmas)
    print(header)
    for rt in sorted({r["r_over_t"] for r in rows}):
        cells = []
        for sg in sigmas:
            got = {r["k"]: r["speedup"] for r in rows if r["r_over_t"] == rt and r["sigma"] == sg}
            cells.append(f"{'':10s}{got[1]:5.2f}x {got[2]:4.2f}x")
        print(f"{rt:<5g} " + "  ".join(cells))
    print("  idle shares in the model at sigma 1 (trainer waiting / servers' unused decode slots), k = 0, 1, 2:")
    for rt in sorted({r["r_over_t"] for r in rows}):
        got = sorted((r for r in rows if r["r_over_t"] == rt and r["sigma"] == 1.0), key=lambda r: r["k"])
        print(f"  R/T {rt:<4g} " + "   ".join(f"k={r['k']}: {r['trainer_idle']:4.0%} / {r['server_idle']:4.0%}"
                                             for r in got))


# =================================================================================================
# The driver
# =================================================================================================


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=None, help="steps per configuration (default 8; --quick 5)")
    p.add_argument("--skip", type=int, default=2, help="first steps not counted (start-up, filling the buffer)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (8 samples each, as in the demo)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--poll-s", type=float, default=POLL_S, help="polling period (CPU time, the server's /metrics)")
    p.add_argument("--no-server-poll", action="store_true", help="do not poll the server's /metrics (no idle share)")
    p.add_argument("--rounds", type=int, default=None,
                   help="launches of each configuration, alternating (A B C D A B C D); default 3, --quick 1")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP + " (k1 only)")
    a = p.parse_args()
    if a.smoke:
        a.configs, a.prompts, a.steps, a.skip, a.rounds = ["k1"], 2, 3, 2, 1
    a.steps, a.rounds = a.steps or (5 if a.quick else 8), a.rounds or (1 if a.quick else 3)
    if a.steps <= a.skip:
        p.error(f"--steps {a.steps} must exceed --skip {a.skip}")

    from hybrid_rl.demo.__main__ import prepare
    from hybrid_rl.sidecar.etcd_server import EtcdProcess
    from hybrid_rl.utils.env import set_runtime_defaults

    set_runtime_defaults()
    (common.CACHE / "logs").mkdir(parents=True, exist_ok=True)
    root = common.CACHE / "async"
    if a.smoke:  # the demo's random base model: its supervised warm-up alone takes minutes
        warm, data = smoke_model(root / "smoke")
    else:
        warm, data = prepare(root / "demo")
    print(f"async benchmark: demo workload, {a.prompts} prompts x {N} samples, {a.steps} steps per launch (first "
          f"{a.skip} not counted), {a.rounds} round(s) of: {', '.join(a.configs)}", flush=True)
    etcd = None
    if any(CONFIGS[c] is not None for c in a.configs):
        shutil.rmtree(root / "etcd", ignore_errors=True)
        etcd = EtcdProcess(root / "etcd")
        etcd.start()
    runs: dict[str, list[Run]] = {name: [] for name in a.configs}
    try:
        for i in range(a.rounds):
            for name in a.configs:
                run = run_config(name, CONFIGS[name], out=root / f"{name}_r{i}", warm=warm, data=data, a=a, etcd=etcd)
                runs[name].append(run)
                step_s = [r["timing/step_s"] for r in run.records]
                print(f"  round {i + 1} {name:9s} {a.prompts * N * len(step_s) / sum(step_s):6.1f} samples/s, step "
                      f"{common.median(step_s):.2f} s (median), launch {run.wall_s:.0f} s, load average "
                      f"{run.load_avg[0]:.1f} -> {run.load_avg[1]:.1f}", flush=True)
    finally:
        if etcd is not None:
            etcd.stop()
    rows = [summarize(name, CONFIGS[name], runs[name], a) for name in a.configs]
    common.write_result("async", figures(rows, a), quick=a.quick)


def smoke_model(root: Path) -> tuple[Path, Path]:
    from hybrid_rl.demo.task import write_task
    from hybrid_rl.model.tiny import TinySpec, build_tiny_model

    data, base = root / "data", root / "base_model"
    if not (data / "val.jsonl").exists():
        write_task(data, n_train=64, n_val=8, fixed_position=2)
    if not (base / "config.json").exists():
        build_tiny_model(base, TinySpec())
    return base, data


def figures(rows: list[dict], a) -> dict:
    by = {r["name"]: r for r in rows}
    for r in rows:
        for base in ("k0", "colocated"):
            if base in by and base != r["name"]:
                r[f"samples_per_s_vs_{base}"] = r["samples_per_s"] / by[base]["samples_per_s"]
    print(common.table(rows, [
        ("name", "config", "s"), ("samples_per_s", "samples/s", ".1f"), ("trained_tokens_per_s", "trained tok/s", ".0f"),
        ("response_tokens_per_s", "response tok/s", ".0f"), ("step_s_median", "step s (median)", ".2f"),
        ("trainer_wait_share", "trainer waits", ".1%"), ("server_idle_share", "server idle", ".1%"),
        ("server_idle_tokens_share", "(tokens)", ".1%"), ("run_cores", "cores used", ".2f"),
        ("server_cores", "by server", ".2f"), ("server_cores_idle", "server idle: cores", ".2f"),
        ("samples_per_s_vs_k0", "vs k0", ".2f"),
        ("samples_per_s_vs_colocated", "vs colocated", ".2f")]))
    print("  samples and tokens per second of step time, over all measured steps; trained tokens = prompt + response;\n"
          "  trainer waits: for generation (colocated, k0) or for the buffer (k1, k2), share of step time;\n"
          "  server idle: share of the measured steps' wall time with no request running or waiting at the polls\n"
          "  (every 50 ms), (tokens): without a token counted between two polls; the truth lies between the two;\n"
          "  colocated: 1 - rollout share;\n"
          "  cores used: CPU seconds of all the launch's processes / wall seconds, by server: of the vLLM server's,\n"
          "  server idle: cores: the server's CPU use while idle by both tests")
    sim = simulate()
    print_simulation(sim)
    headline = [{"what": f"{r['name']}: samples/s vs k0 (sync sidecar)", "value": round(r["samples_per_s_vs_k0"], 4)}
                for r in rows if "samples_per_s_vs_k0" in r and r["name"] != "colocated"]
    headline += [{"what": f"{r['name']}: samples/s vs colocated", "value": round(r["samples_per_s_vs_colocated"], 4)}
                 for r in rows if "samples_per_s_vs_colocated" in r]
    pick = {(s["r_over_t"], s["sigma"], s["k"]): s["speedup"] for s in sim}
    headline.append({"what": "MODEL (GPU, R/T=2, sigma=1): k=1 samples/s vs sync", "value": round(pick[(2.0, 1.0, 1)], 4)})
    return {"workload": {"recipe": "grpo", "model": "demo (tiny warmed-up qwen2, fp32)", "prompts": a.prompts, "n": N,
                         "max_new_tokens": 8, "steps": a.steps, "skip": a.skip, "rounds": a.rounds, "nproc": 2},
            "configs": rows, "simulation": sim, "targets": [], "headline": headline}


if __name__ == "__main__":
    main()
