"""The three tiny architectures the planner must count exactly (built once per session by tests/conftest.py)."""

import pytest

ARCHS = ("qwen2", "llama_tied_kv1", "qwen3")  # q/k/v biases, untied; tied embeddings with 1 KV head; q/k norms


@pytest.fixture(scope="session")
def arch_paths(tiny_models) -> dict[str, str]:
    return {name: tiny_models[name] for name in ARCHS}
