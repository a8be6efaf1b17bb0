"""Fixtures for the data-layer tests: the tiny offline tokenizer and writers for JSONL / Parquet files."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybrid_rl.model.tiny import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny byte-level BPE with a chat template (built once: ~2 s). Do not mutate it in a test."""
    return build_tokenizer()


@pytest.fixture(scope="session")
def tokenizer_without_template(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    return plain


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., str]:
    """Write rows (dicts, or raw strings written verbatim as lines) to a .jsonl file; return its path."""

    def write(rows: list[Any], name: str = "data.jsonl") -> str:
        path = tmp_path / name
        lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return str(path)

    return write


@pytest.fixture
def write_parquet(tmp_path: Path) -> Callable[..., str]:
    """Write a list of dict rows to a .parquet file; return its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(rows: list[dict[str, Any]], name: str = "data.parquet") -> str:
        path = tmp_path / name
        pq.write_table(pa.Table.from_pylist(rows), path)
        return str(path)

    return write
