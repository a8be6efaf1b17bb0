"""End-to-end fixtures: the demo task's data (prompts and preference pairs) on a tiny random model."""

from pathlib import Path

import pytest

from hybrid_rl.demo.data import write_preferences
from hybrid_rl.demo.task import write_task


@pytest.fixture(scope="session")
def reward_model(tiny_models, tmp_path_factory) -> str:
    """A sequence-classification reward model on the tiny Qwen2 backbone (random score head)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("rm")
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_models["qwen2"], num_labels=1, dtype=torch.float32)
    rm.config.pad_token_id = AutoTokenizer.from_pretrained(tiny_models["qwen2"]).pad_token_id
    rm.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_models["qwen2"]).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def model_without_pad_token(tiny_models, tmp_path_factory) -> str:
    """The tiny model with a tokenizer that has no pad token (like many base-model tokenizers)."""
    import shutil

    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("nopad")
    for f in Path(tiny_models["qwen2"]).iterdir():
        if f.suffix in (".json", ".safetensors", ".jinja") and not f.name.startswith("tokenizer"):
            shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(tiny_models["qwen2"])
    tok.pad_token = None
    tok.save_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).pad_token_id is None
    return str(out)


@pytest.fixture(scope="session")
def task_files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("task")
    train, val = write_task(root, n_train=64, n_val=8)
    prefs = write_preferences(train, Path(root) / "prefs.jsonl")
    return {"train": str(train), "val": str(val), "prefs": str(prefs)}


def tiny_overrides(model: str, data: dict[str, str], out: Path, *, fp32: bool = True, **extra) -> list[str]:
    """A fast configuration for CPU tests: tiny batches, short responses, one reward worker; fp32 training and
    rollout, or with `fp32=False` the configuration's default dtypes (what users get)."""
    base = {
        "model.path": model, "data.train_files": f"[{data['train']}]", "data.val_files": f"[{data['val']}]",
        "data.val_prompts": 4, "data.prompts_per_step": 4, "rollout.n": 4, "rollout.max_new_tokens": 8,
        "rollout.tp": 1, "trainer.total_steps": 2,
        "trainer.output_dir": str(out), "trainer.micro_batch_tokens": 256, "trainer.show_progress": "false",
        "reward.num_workers": 1, "optim.lr": "1e-4", "rollout.bucket_mb": 1,
    }
    if fp32:
        base.update({"model.dtype": "float32", "rollout.dtype": "float32"})
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> Path:
    """The demo's folder with its task data and warmed-up model, built once for every demo test (about a minute)."""
    from hybrid_rl.demo.__main__ import prepare

    root = tmp_path_factory.mktemp("demo")
    prepare(root, log=lambda *a: None)
    return root


@pytest.fixture(scope="session")
def tools_demo_root(tmp_path_factory) -> Path:
    """The tools demo's folder with its task data and warmed-up model, built once: a shorter warm-up than the demo's
    (200 steps of 16 conversations, not 250 of 32: it is most of the test's cost; 120 steps are too few)."""
    from hybrid_rl.demo.__main__ import prepare_tools

    root = tmp_path_factory.mktemp("tools_demo")
    prepare_tools(root, log=lambda *a: None, warmup_batch=16, warmup_steps=200)
    return root
