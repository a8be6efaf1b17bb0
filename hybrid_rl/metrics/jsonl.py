"""metrics.jsonl: one JSON object per step, appended and flushed each step, continued across resumes.

Non-finite values are written as null, so every line is strict JSON (Python's default would write
`NaN`, which `jq`, pandas' strict readers and browsers reject).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def to_record(step: int, metrics: dict[str, float]) -> dict[str, Any]:
    """{"step": step, **metrics} with every value a float, or None where it is NaN or infinite."""
    if "step" in metrics:
        raise ValueError("metrics must not contain the key 'step': it is the record's own step field")
    record: dict[str, Any] = {"step": int(step)}
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"metric {key!r} = {value!r} is not a number; log only scalars "
                             "(use .item() on tensors)") from e
        record[key] = number if math.isfinite(number) else None
    return record


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a line that does not parse (a crash mid-write) is skipped,
    and NaN/Infinity tokens (from other writers) are read as None."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line, parse_constant=lambda _: None)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


class JsonlWriter:
    """Appends records to `path`; on resume (`start_step` > 0) first drops records with step >= start_step.

    Those are steps logged after the checkpoint being resumed was written; they are about to be run
    again, and keeping them would leave every such step in the file twice. A second record for the
    step just written (validation metrics logged after the training ones) is merged into its line,
    so the file keeps one object per step.
    """

    def __init__(self, path: Path, *, start_step: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            _truncate_from(path, start_step)
        self.path = path
        self._file = path.open("ab")
        self._last: dict[str, Any] | None = None
        self._last_offset = 0

    def write(self, record: dict[str, Any]) -> None:
        self._file.seek(0, os.SEEK_END)
        if self._last is not None and record["step"] == self._last["step"]:
            record = {**self._last, **record}
            self._file.truncate(self._last_offset)
        else:
            self._last_offset = self._file.tell()
        self._file.write((json.dumps(record, allow_nan=False) + "\n").encode())
        self._file.flush()
        self._last = record

    def close(self) -> None:
        self._file.close()


def _truncate_from(path: Path, start_step: int) -> None:
    """Rewrite `path` without records of step >= start_step (atomically: a temp file, then a rename)."""
    kept = [r for r in read_records(path) if r["step"] < start_step]
    dropped = sum(1 for line in path.read_text().splitlines() if line.strip()) - len(kept)
    if dropped == 0:
        return
    log.info("metrics: dropping %d record(s) of %s from step %d on (they will be logged again)",
             dropped, path, start_step)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
    os.replace(tmp, path)
