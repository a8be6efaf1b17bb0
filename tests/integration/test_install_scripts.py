"""What `make install` decides, per deployment, checked on this CPU machine as a GPU host would meet it.

The base install is what colocated mode needs: no etcd, no bubblewrap (named steps `make install-sidecar` and
`make install-sandbox`, which `make test` runs first). flash-attn on CUDA either installs (a prebuilt wheel, or a
compile where nvcc is) or says why not and what the fallback costs. The scripts run for real on a PATH of
stand-ins (no root, no bubblewrap, no etcd, a CUDA torch that is not there) that write down how they were called;
the Makefile's decisions are read with `make -n` (prints the commands, runs none).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
BASH = shutil.which("bash") or "/bin/bash"
# A CUDA torch 2.13 on Python 3.11 with the new C++ ABI, as `python -c` answers the script's questions.
CUDA_PYTHON = """case "$*" in
  *"import flash_attn"*) exit 1 ;;
  *"import sys, torch"*) echo "2.13.0 12.9 TRUE cp311" ;;
  "-m pip"*) exit 0 ;;
esac"""
WHEEL = "flash_attn-2.8.3+cu12torch2.13cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"


def _run(tmp_path: Path, script: str, *args: str, env: dict | None = None, **tools: str):
    """Run `script` with PATH = a folder holding only `tools` (name -> sh body, each logging its calls)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(exist_ok=True)
    log.touch()
    for name, body in tools.items():
        stand_in = bin_dir / name.replace("_", "-")
        stand_in.write_text(f'#!/bin/sh\necho "{name} $* MAX_JOBS=$MAX_JOBS" >> "{log}"\n{body}\n')
        stand_in.chmod(0o755)
    args = [str(bin_dir / a) if (bin_dir / a).exists() else a for a in args]
    r = subprocess.run([BASH, str(SCRIPTS / script), *args], env={"PATH": str(bin_dir), **(env or {})},
                       capture_output=True, text=True, timeout=60)
    return r, log.read_text()


def test_install_check_names_each_skipped_step_and_its_command(tmp_path):
    r, _ = _run(tmp_path, "install_check.sh")  # no etcd, no bwrap on PATH
    assert r.returncode == 0
    assert "skipped: etcd, needed only by sidecar mode (rollout.mode=sidecar) and its tests: make install-sidecar" in r.stdout
    assert "skipped: bubblewrap, needed only by the code reward's sandbox" in r.stdout and "make install-sandbox" in r.stdout
    assert "colocated mode (the hybrid engine, every recipe, make demo) needs neither" in r.stdout
    r, _ = _run(tmp_path, "install_check.sh", etcd="exit 0", bwrap="exit 0")
    assert r.returncode == 0 and r.stdout == ""


def test_etcd_step_without_root_or_sudo_says_what_to_do(tmp_path):
    r, calls = _run(tmp_path, "install_etcd.sh", id="echo 1000", sudo="exit 1", apt_get="exit 1")
    assert r.returncode == 1
    assert "etcd is not installed and this user cannot install it (needs root or passwordless sudo)" in r.stderr
    assert "apt_get" not in calls  # nothing was attempted


def test_flash_attn_on_a_cpu_torch_is_skipped_with_the_reason(tmp_path):
    real = _run(tmp_path, "install_flash_attn.sh", sys.executable)[0]  # this venv: CPU torch
    assert real.returncode == 0 and "is not a CUDA build" in real.stderr


def test_flash_attn_without_a_wheel_or_nvcc_names_the_wheel_and_the_cost(tmp_path):
    r, calls = _run(tmp_path, "install_flash_attn.sh", "python", python=CUDA_PYTHON, curl="exit 22")
    assert r.returncode == 0, r.stderr  # never fails the install
    assert f"has no prebuilt wheel for this venv ({WHEEL} is not on its release page" in r.stderr
    assert "nvcc, which is\n  not on PATH" in r.stderr and "Install the CUDA toolkit 12.9" in r.stderr
    assert "SDPA once per sequence per layer" in r.stderr and "1792 attention calls per forward" in r.stderr  # cost
    assert "make install-flash-attn" in r.stderr
    assert "pip" not in calls  # nothing half-built


def test_flash_attn_takes_the_prebuilt_wheel_when_it_exists(tmp_path):
    r, calls = _run(tmp_path, "install_flash_attn.sh", "python", python=CUDA_PYTHON, curl="exit 0")
    assert r.returncode == 0 and f"installing the prebuilt wheel {WHEEL}" in r.stdout
    url = f"https://github.com/Dao-AILab/flash-attention/releases/download/v2.8.3/{WHEEL}"
    assert f"curl -sfIL --max-time 30 {url}" in calls
    assert f"python -m pip install -q {url}" in calls and "no-build-isolation" not in calls


def test_flash_attn_compiles_with_its_build_deps_when_nvcc_is_there(tmp_path):
    r, calls = _run(tmp_path, "install_flash_attn.sh", "python", python=CUDA_PYTHON, curl="exit 22", nvcc="exit 0")
    assert r.returncode == 0 and "compiling 2.8.3" in r.stdout
    pip = [c for c in calls.splitlines() if c.startswith("python -m pip")]
    assert pip[0].startswith("python -m pip install -q wheel packaging ninja psutil")  # --no-build-isolation needs them
    assert pip[1].startswith("python -m pip install -q --no-build-isolation flash-attn==2.8.3 MAX_JOBS=8")


def test_flash_attn_skip_and_already_installed(tmp_path):
    r, calls = _run(tmp_path, "install_flash_attn.sh", "python", env={"FLASH_ATTN": "skip"}, python=CUDA_PYTHON)
    assert r.returncode == 0 and "FLASH_ATTN=skip" in r.stderr and calls == ""
    r, _ = _run(tmp_path, "install_flash_attn.sh", "python", python='echo 2.8.3')
    assert r.returncode == 0 and "flash-attn 2.8.3 already installed" in r.stdout


def _make_n(tmp_path: Path, target: str, *, cuda: bool) -> str:
    """The commands `make -n target` would run, with or without a working `nvidia-smi -L` on PATH."""
    make = shutil.which("make")
    assert make, "make is not installed"
    bin_dir = tmp_path / ("cuda" if cuda else "cpu")
    bin_dir.mkdir(exist_ok=True)
    if cuda:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    path = os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"])
    r = subprocess.run([make, "-n", "-B", target], cwd=REPO, env={"PATH": path, "HOME": str(tmp_path)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("cuda", [False, True])
def test_make_install_is_the_colocated_base_and_make_test_adds_etcd_and_the_sandbox(tmp_path, cuda):
    base = _make_n(tmp_path, "install", cuda=cuda)
    assert ("requirements/cuda.txt" in base) == cuda and ("requirements/cpu.lock" in base) != cuda
    assert ("install_flash_attn.sh" in base) == cuda
    assert "install_etcd.sh" not in base and "install_sandbox.sh" not in base
    assert "install_check.sh" in base
    full = _make_n(tmp_path, "test", cuda=cuda)
    assert "install_etcd.sh" in full and "install_sandbox.sh" in full and "pytest tests" in full
    assert "install_etcd.sh" in _make_n(tmp_path, "install-sidecar", cuda=cuda)


def test_make_test_fast_needs_only_the_base_install_and_runs_tests_unit(tmp_path):
    fast = _make_n(tmp_path, "test-fast", cuda=False)
    assert "install_etcd.sh" not in fast and "install_sandbox.sh" not in fast and "install_check.sh" in fast
    assert "-m pytest tests/unit" in fast and "-n 2" not in fast


def test_make_fmt_fixes_what_ruff_check_can_and_does_not_reformat(tmp_path):
    fmt = _make_n(tmp_path, "fmt", cuda=False)
    assert "ruff check --fix hybrid_rl tests benchmarks" in fmt and "ruff format" not in fmt
