"""GPU checks (`make test-gpu`): the training side of the product on one CUDA device, without vLLM.

`make test` (CI, CPU machines) does not collect this folder; here every test needs CUDA and fails, never skips,
without it. Models are Qwen2.5's published shapes with random bf16 weights, built on the device in seconds
(nothing is downloaded). $HR_GPU_REPORT, when set, is a folder that receives each check's figures (JSON).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Qwen2.5-{0.5B,1.5B}'s published config.json values (both tie their embeddings).
SHAPES = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
}


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
    from transformers import AutoModelForCausalLM, Qwen2Config

    from hybrid_rl.model.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen2Config(**SHAPES[size], vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                      max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id,
                      dtype="bfloat16")
    cfg.architectures = ["Qwen2ForCausalLM"]
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
