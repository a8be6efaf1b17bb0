"""Read raw rows from JSON Lines and Parquet files, each tagged with the file and line it came from.

This module knows about files only: it parses them into plain `dict` rows and raises `DatasetError` for what
goes wrong at that level (missing file, unknown extension, malformed JSON, a row that is not an object, no rows
at all). What a row must contain is checked by `datasets.py`, which reuses the location to name the culprit.

Locations are 1-based line numbers for JSON Lines (what an editor shows) and 0-based row numbers for Parquet
(what `pyarrow.Table.slice` and pandas use); the message says which.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_rl.errors import DatasetError  # noqa: F401 - raised here; its home is hybrid_rl.errors

JSON_LINES_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
# Chat messages with tool calls nest under ten levels. A row nested thousands deep overflows the Python stack of
# whoever walks it (the parser here, a copy, a pickle to a worker): refused by its line instead.
MAX_NESTING = 100
_NESTING = f"a row nested at most {MAX_NESTING} levels deep"


@dataclass(frozen=True)
class RowLocation:
    """Where a row came from: `file` plus a line (JSON Lines, 1-based) or a row (Parquet, 0-based)."""

    file: str
    number: int
    is_parquet: bool

    def __str__(self) -> str:
        if self.is_parquet:
            return f"{self.file} row {self.number} (0-based)"
        return f"{self.file} line {self.number}"

    def error(self, problem: str, expected: str) -> DatasetError:
        """Build the error to raise for this row: `<file> line <n>: <problem>; expected <expected>`."""
        return DatasetError(f"{self}: {problem}; expected {expected}")


@dataclass(frozen=True)
class SourceRow:
    """One parsed row (a JSON object or a Parquet record) and its location."""

    where: RowLocation
    data: dict[str, Any]


def read_rows(files: Sequence[str]) -> list[SourceRow]:
    """Parse every row of `files`, in order; raise `DatasetError` on the first unreadable file or row.

    Blank lines in JSON Lines files are skipped (a trailing newline is common); everything else must be one
    JSON object per line. `.json` is read as JSON Lines too, not as one JSON array.
    """
    if isinstance(files, str):
        # A bare string is a Sequence[str] of characters: catch it here rather than "file not found: 't'".
        raise TypeError(f"files must be a list of paths, got the string {files!r}; wrap it in a list")
    if not files:
        raise DatasetError("no data files given; expected at least one .jsonl, .json or .parquet path")
    rows: list[SourceRow] = []
    for file in files:
        rows.extend(_read_file(str(file)))
    if not rows:
        raise DatasetError(f"no rows in {list(map(str, files))}; expected at least one row in total")
    return rows


def _read_file(file: str) -> list[SourceRow]:
    path = Path(file)
    suffix = path.suffix.lower()
    if suffix not in JSON_LINES_SUFFIXES + PARQUET_SUFFIXES:
        raise DatasetError(
            f"{file}: unknown extension {path.suffix!r}; expected one of {JSON_LINES_SUFFIXES + PARQUET_SUFFIXES}"
        )
    if not path.is_file():
        raise DatasetError(f"{file}: file not found; expected an existing {suffix} file")
    if suffix in PARQUET_SUFFIXES:
        return _read_parquet(file)
    return _read_json_lines(file)


def _read_json_lines(file: str) -> list[SourceRow]:
    rows = []
    with open(file, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = RowLocation(file, number, is_parquet=False)
            try:
                # utf-8-sig drops a byte-order mark, which some editors write at the start of the file.
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise where.error(f"invalid UTF-8 ({e.reason} at byte {e.start})", "UTF-8 text") from e
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except RecursionError:
                raise where.error("the row is nested too deeply to parse", _NESTING) from None
            except json.JSONDecodeError as e:
                # A pretty-printed JSON array fails on its first line: say so rather than only "malformed".
                hint = ", the file looks like one JSON array" if number == 1 and line.lstrip().startswith("[") else ""
                raise where.error(
                    f"malformed JSON ({e.msg} at column {e.colno}){hint}", "one JSON object per line (JSON Lines)"
                ) from e
            if not isinstance(value, dict):
                raise where.error(
                    f"the row is a JSON {type(value).__name__}, not an object", "one JSON object per line (JSON Lines)"
                )
            _check_nesting(value, where)
            rows.append(SourceRow(where, value))
    return rows


def _check_nesting(value: Any, where: RowLocation) -> None:
    """Refuse a row nested deeper than MAX_NESTING (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_NESTING:
            raise where.error(f"the row is nested more than {MAX_NESTING} levels deep", _NESTING)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def _read_parquet(file: str) -> list[SourceRow]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{file}: cannot read as Parquet ({e}); expected a valid Parquet file") from e
    # to_pylist turns list<struct<role, content>> columns into lists of dicts, as json.loads would.
    rows = [SourceRow(RowLocation(file, i, is_parquet=True), row) for i, row in enumerate(table.to_pylist())]
    for row in rows:
        _check_nesting(row.data, row.where)
    return rows
