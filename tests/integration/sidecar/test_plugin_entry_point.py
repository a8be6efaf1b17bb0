"""The vLLM plugin's entry point is declared in pyproject.toml, so `pip install .` (and any built image) has it, and
the install `make install` made (`pip install -e .`) carries it where vLLM looks: the installed metadata."""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib

from tests.conftest import REPO


def test_pip_metadata_and_the_install_declare_the_vllm_plugin(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copy(REPO / "README.md", src)
    os.symlink(REPO / "hybrid_rl", src / "hybrid_rl")
    # What pip builds from: setuptools reads the same pyproject.toml (its metadata step only: no wheel, no copy)
    (tmp_path / "meta").mkdir()
    r = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "egg_info", "--egg-base",
                        str(tmp_path / "meta")], cwd=src, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    built = (tmp_path / "meta" / "hybrid_rl.egg-info" / "entry_points.txt").read_text()
    assert "[vllm.general_plugins]" in built and "hybrid_rl = hybrid_rl.sidecar.vllm_plugin:register" in built
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"]["vllm.general_plugins"]
    installed = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert all(installed.get(k) == v for k, v in declared.items()), installed
