"""Shared helpers of the benchmark scripts: machine facts, result files, tiny models, torchrun, A/B timing.

Every figure a benchmark reports is a ratio against a baseline measured in the same run on the same
machine, the two sides alternated (A B A B ...) and summarised by their medians, so that load from
other jobs on the machine falls on both sides alike. The load average at the start and the end of
each run goes into its JSON.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# HR_BENCH_RESULTS redirects result files (the smoke test writes to a temporary folder, not over the figures).
RESULTS = Path(os.environ.get("HR_BENCH_RESULTS") or HERE / "results")
SMOKE_HELP = ("smallest shapes, one repeat, seconds: checks that the script runs end to end (make test does); "
              "its figures mean nothing")
CACHE = HERE / ".cache"  # built models and run outputs (git-ignored: `.cache/`)
_START = {"load_avg": os.getloadavg(), "time": time.time()}
# The environment as the user launched the script, before `set_runtime_defaults` adds this project's settings.
_LAUNCH_ENV = dict(os.environ)
HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"  # torch's knob for huge pages under host tensors (a runtime default of ours)


def peer_env(*, huge_pages: bool) -> dict[str, str]:
    """The environment for a peer (TRL): the user's own, none of our runtime defaults, our huge-page setting only
    when asked (`--trl-huge-pages`: it speeds up TRL's CPU step as it does ours); offline, quiet, OMP threads unset."""
    env = {k: v for k, v in _LAUNCH_ENV.items() if k not in ("OMP_NUM_THREADS", "VIRTUAL_ENV")}
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    if huge_pages:
        env[HUGE_PAGES] = "1"
    return env

# Named model sizes: (hidden, layers, heads, kv_heads, intermediate). Params include embeddings.
SIZES = {
    "4M": (256, 4, 4, 2, 1024),  # ~4.2M
    "12M": (256, 12, 4, 2, 1024),  # ~12M
    "25M": (512, 6, 8, 4, 2048),  # ~24.6M
}


# -- machine and result files ---------------------------------------------------------------------


def machine_facts() -> dict:
    """What a reader needs to compare this result with another: CPU, threads, versions, load."""
    flags, model = set(), platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    facts = {
        "cpu": model,
        "cpus": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    for mod in ("torch", "vllm", "transformers"):
        try:
            facts[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing package is a fact too
            facts[mod] = None
    try:
        import torch

        facts["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        facts["cuda"] = None
    return facts


def write_result(name: str, payload: dict, *, quick: bool) -> Path:
    """`benchmarks/results/<name>.json`: the figures plus machine facts, command, date and load."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {
        "benchmark": name,
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "quick": quick,
        "smoke": "--smoke" in sys.argv,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_s": round(time.time() - _START["time"], 1),
        "load_avg_start": [round(x, 2) for x in _START["load_avg"]],
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "machine": machine_facts(),
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, **payload}, indent=2, default=_jsonable) + "\n")
    print(f"wrote {_shown(path)}  (load average {meta['load_avg_start'][0]} -> "
          f"{meta['load_avg_end'][0]} on {meta['machine']['cpus']} CPUs)")
    return path


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


# -- verdicts and tables --------------------------------------------------------------------------


def verdict(value: float, target: float, *, higher_is_better: bool) -> str:
    ok = value >= target if higher_is_better else value <= target
    return "met" if ok else "MISSED"


def check(label: str, value: float, target: float, *, higher_is_better: bool, unit: str = "x") -> dict:
    """Print one target line (MISSED is never hidden) and return it for the JSON."""
    v = verdict(value, target, higher_is_better=higher_is_better)
    op = ">=" if higher_is_better else "<="
    print(f"  target {label}: {value:.3g}{unit} (target {op} {target:g}{unit}) -> {v}")
    return {"what": label, "value": round(value, 4), "target": f"{op} {target:g}", "verdict": v}


def table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """Rows as an aligned text table; columns are (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c[i].rjust(widths[i]) if i else c[i].ljust(widths[i]) for i in range(len(c))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- timing ---------------------------------------------------------------------------------------


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def alternate(sides: dict[str, Callable[[], float | None]], repeats: int) -> dict[str, list[float]]:
    """Run the sides in turn, A B A B ..., `repeats` rounds. Each call returns its own measurement (seconds,
    or a rate) or None, and is then timed here (seconds). Returns each side's measurements, in order."""
    out: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            got = fn()
            out[name].append(got if got is not None else time.perf_counter() - t0)
    return out


# -- models ---------------------------------------------------------------------------------------


def tiny_model(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, *,
               arch: str = "qwen2") -> Path:
    """A random-weight model folder built offline once and cached under benchmarks/.cache/models."""
    from hybrid_rl.model.tiny import TinySpec, build_tiny_model

    spec = TinySpec(arch=arch, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                    intermediate=intermediate)
    path = CACHE / "models" / f"{arch}_h{hidden}_l{layers}_a{heads}_kv{kv_heads}_i{intermediate}"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        build_tiny_model(tmp, spec)
        tmp.rename(path)
    return path


def task_files() -> tuple[str, str]:
    """The demo task's train and validation prompts (`hybrid_rl.demo.task`), written once under .cache/task."""
    from hybrid_rl.demo.task import write_task

    root = CACHE / "task"
    train, val = root / "train.jsonl", root / "val.jsonl"
    if not train.exists():
        write_task(root, n_train=2048, n_val=64)
    return str(train), str(val)


def sized_model(size: str) -> Path:
    return tiny_model(*SIZES[size])


def param_counts(model_dir: str | Path) -> dict[str, int]:
    """Parameter counts from config.json: total, embedding, and N = non-embedding + lm_head (the FLOPs count)."""
    from hybrid_rl.model.loading import load_config
    from hybrid_rl.planner.param_count import model_params

    params = model_params(load_config(str(model_dir)))
    total = sum(p.numel for p in params)
    embed = sum(p.numel for p in params if p.name.endswith("embed_tokens.weight"))
    tied = not any(p.name == "lm_head.weight" for p in params)
    return {"total": total, "embedding": embed, "flops_n": total if tied else total - embed}  # a tied head = embed


# -- launching ------------------------------------------------------------------------------------


def torchrun(script: str | Path, args: Sequence[str], *, nproc: int, timeout: int, tag: str,
             env: dict | None = None) -> dict:
    """Run `script args` under torchrun; the worker's rank 0 writes JSON to $HR_BENCH_OUT, returned here.

    On failure the tail of the output is printed and RuntimeError raised.
    """
    CACHE.mkdir(parents=True, exist_ok=True)
    out = CACHE / f"result_{tag}_{os.getpid()}.json"
    out.unlink(missing_ok=True)
    full_env = {**os.environ, "HR_BENCH_OUT": str(out), "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           str(script), *args]
    proc = subprocess.run(cmd, env=full_env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    log = CACHE / "logs" / f"{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        print(tail, file=sys.stderr)
        raise RuntimeError(f"torchrun {Path(script).name} {tag} failed (exit {proc.returncode}); full output: {log}")
    result = json.loads(out.read_text())
    out.unlink()
    return result


def worker_write(result: dict) -> None:
    """Called by a torchrun worker's rank 0."""
    Path(os.environ["HR_BENCH_OUT"]).write_text(json.dumps(result, default=_jsonable))


def matmul_rate(dtype, *, n: int = 1024, seconds: float = 1.0, device=None) -> float:
    """FLOP/s of a square `torch.matmul` in `dtype` on `device` (default: this rank's device) with the
    current thread count; the best of repeated calls over `seconds`."""
    import torch

    from hybrid_rl.distributed.mesh import device as default_device

    dev = device or default_device()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    torch.matmul(a, b)
    sync()
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        torch.matmul(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def memory_bandwidth(*, mib: int = 256, seconds: float = 1.0) -> float:
    """Bytes/s of a large `copy_` (read + write counted): the best of repeats with one thread and with one per core
    (the higher: on a loaded machine the multi-threaded copy can lose more to waiting than it gains)."""
    import torch

    threads = torch.get_num_threads()
    src = torch.ones(mib * 2**18)  # float32
    dst = torch.empty_like(src)
    best = float("inf")
    try:
        for n in sorted({1, os.cpu_count() or 1}):
            torch.set_num_threads(n)
            dst.copy_(src)
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end:
                t0 = time.perf_counter()
                dst.copy_(src)
                best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2 * src.nbytes / best
