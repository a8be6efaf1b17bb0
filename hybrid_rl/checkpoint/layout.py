"""On-disk layout of a checkpoint, its manifest, and how to tell a complete checkpoint from a partial one.

    root/
      step_120/              a complete checkpoint: renamed from step_120.tmp by its filesystem's leader rank
        COMPLETE             the manifest (JSON): step, world, components, the ranks whose files this copy holds,
                             and the size of every file
        policy/rank0/        one component, rank 0's part: DCP (.metadata + __0_0.distcp), complete by itself
        policy/rank1/        ... one folder per rank
        rank0.pt rank1.pt    per-rank state (RNG states, data-loader position), torch.save
        shared.pt            state common to all ranks (step, scheduler, KL controller, config), torch.save
        done.rank0 ...       each rank's "my files are written and fsynced" marker, listing them with sizes
      step_130.tmp/          a save in progress or one that crashed: never loaded, removed by the next save

File sizes in the manifest catch truncation without re-reading the data. Anything else unreadable
(garbled DCP metadata) is caught when loading it fails, which is agreed on by all ranks.
`root` is one filesystem seen by every rank (a node's disk, NFS, Lustre), or one per node (node-local disks,
each node its own `trainer.output_dir`): then each node's copy holds its own ranks' files and `shared.pt`, and
its manifest lists those ranks (`sites.py`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

COMPLETE = "COMPLETE"
SHARED = "shared.pt"
FORMAT = 2  # 2: one DCP folder per rank (1: one global DCP folder per component)
OTHER_RANKS = "this copy holds the files of ranks"
_STEP_DIR = re.compile(r"^step_(\d+)(\.tmp)?$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}.tmp"


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def done_marker(rank: int) -> str:
    return f"done.rank{rank}"


def is_marker(rel: str) -> bool:
    return rel.startswith("done.rank")


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds; written last, as the COMPLETE file."""

    step: int
    world: int
    components: dict[str, bool]  # component name -> whether its optimizer state was saved
    files: dict[str, int]  # path relative to the checkpoint dir -> size in bytes
    ranks: tuple[int, ...] = ()  # the ranks whose files this copy holds (all when one filesystem holds them)
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        return cls(step=int(d["step"]), world=int(d["world"]), components=dict(d["components"]),
                   files={str(k): int(v) for k, v in d["files"].items()},
                   ranks=tuple(int(r) for r in d.get("ranks", range(int(d["world"])))), format=int(d["format"]))


def read_manifest(path: Path) -> Manifest:
    return Manifest.from_json((path / COMPLETE).read_text())


def scan_files(directory: Path) -> dict[str, int]:
    """Every file under `directory` except the manifest and the done markers: relative path -> size."""
    out = {}
    for f in sorted(directory.rglob("*")):
        rel = f.relative_to(directory).as_posix()
        if f.is_file() and rel != COMPLETE and not is_marker(rel):
            out[rel] = f.stat().st_size
    return out


def candidates(root: Path) -> list[Path]:
    """Every `step_<n>` and `step_<n>.tmp` directory, newest step first (a committed one before its .tmp)."""
    found = []
    for p in root.iterdir() if root.is_dir() else []:
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), m.group(2) is None, p))
    return [p for _, _, p in sorted(found, key=lambda t: (t[0], t[1]), reverse=True)]


def problem(path: Path, rank: int | None = None) -> str | None:
    """Why the checkpoint at `path` must not be loaded (by `rank`: its files must be in this copy), or None when it
    is complete and intact."""
    if path.name.endswith(".tmp"):
        return "unfinished save (still a .tmp directory: the save never committed)"
    if not (path / COMPLETE).is_file():
        return f"no {COMPLETE} manifest (the save did not finish)"
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {COMPLETE} manifest ({type(e).__name__}: {e})"
    if manifest.format != FORMAT:
        return f"format {manifest.format}, written by another version of hybrid_rl (this one reads format {FORMAT})"
    if rank is not None and rank not in manifest.ranks:
        return f"{OTHER_RANKS} {list(manifest.ranks)}, not rank {rank}'s"
    for r in manifest.ranks:
        if rank_file(r) not in manifest.files:
            return f"the manifest lists no {rank_file(r)}"
    for rel, size in manifest.files.items():
        f = path / rel
        if not f.is_file():
            return f"missing file {rel}"
        if (actual := f.stat().st_size) != size:
            return f"{rel} is {actual} bytes but was saved with {size} (truncated or overwritten)"
    return None
