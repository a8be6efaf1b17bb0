"""The vLLM plugin's entry point is declared in pyproject.toml, so `pip install .` (and any built image) has it, and
`make install`'s hand-written metadata says the same."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib

from tests.conftest import REPO


def test_pip_metadata_and_make_install_declare_the_vllm_plugin(tmp_path):
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
    spec = importlib.util.spec_from_file_location("write_dist_info", REPO / "scripts" / "write_dist_info.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert mod.entry_points(project).split() == built.split()
