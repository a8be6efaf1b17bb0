"""GPU checks (`make test-gpu`): the training side of the product on one CUDA device, without vLLM.

`make test` (CI, CPU machines) does not collect this folder; here every test needs CUDA and fails, never skips,
without it. Models are Qwen2.5's published shapes with random bf16 weights, built on the device in seconds
(nothing is downloaded). $HR_GPU_REPORT, when set, is a folder that receives each check's figures (JSON).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import qwen_shapes  # noqa: E402 - Qwen2.5's published configs, as the benchmarks build their model folders

SHAPES = qwen_shapes.SHAPES


def pytest_collection_modifyitems(config, items) -> None:
    if not torch.cuda.is_available():
        raise pytest.UsageError("tests/gpu needs a CUDA device (torch.cuda.is_available() is False); on a machine "
                                "without one run `make test`")


def report(name: str, figures: dict) -> None:
    """Write one check's figures to $HR_GPU_REPORT/<name>.json (and print them)."""
    print(name, json.dumps(figures, indent=1))
    folder = os.environ.get("HR_GPU_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.json").write_text(json.dumps(figures, indent=1))


def build_qwen_shape(size: str, path: Path) -> Path:
    """A model folder of Qwen2.5-`size`'s shape at `path`: random bf16 weights made on the GPU, the tests' tokenizer."""
    from transformers import AutoModelForCausalLM

    cfg, tok = qwen_shapes.config(size)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


@pytest.fixture(scope="session")
def qwen_shape(tmp_path_factory):
    """size -> the folder of a model of that Qwen2.5 shape (`build_qwen_shape`), built once per session."""
    built: dict[str, str] = {}

    def get(size: str) -> str:
        if size not in built:
            built[size] = str(build_qwen_shape(size, tmp_path_factory.mktemp(f"qwen2.5-{size}")))
        return built[size]

    return get
