"""Tiny models for the checkpoint tests, built offline once per session (~2 s each)."""

from __future__ import annotations

import pytest

from hybrid_rl.model.tiny import TinySpec, build_tiny_model


@pytest.fixture(scope="session")
def untied_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("qwen2"), TinySpec(arch="qwen2")))


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("llama_tied"), TinySpec(arch="llama", tie_embeddings=True)))
