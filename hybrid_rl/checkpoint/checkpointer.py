"""Checkpointer: atomic, sharded saves of the training state, and a resume that never loads a partial one.

Saving is collective and goes in three agreed phases, each closed by one all-gather of the ranks'
errors, so a failure on any rank becomes the same `CheckpointError` on all of them (no rank is left
in a barrier) and nothing is published:

1. rank 0 removes stale `*.tmp` directories and creates `step_<n>.tmp/`;
2. every rank writes its DCP shards, its `rank<r>.pt` and a `done.rank<r>` marker (rank 0 also `shared.pt`);
3. rank 0 checks every marker against what it sees on disk, writes the `COMPLETE` manifest and renames
   `step_<n>.tmp/` to `step_<n>/`; then it prunes to the newest `keep_last`.

Loading is decided on rank 0 (which checkpoint, is it intact) and broadcast, so all ranks load the
same one. See `layout.py` for the directory format.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybrid_rl.checkpoint import layout
from hybrid_rl.checkpoint.collective import (
    CAUGHT,
    CheckpointError,
    barrier,
    decide_on_rank0,
    is_distributed,
    raise_if_any_failed,
)
from hybrid_rl.checkpoint.files import fsync_dir, replace_dir, torch_bytes, torch_read, write_durable
from hybrid_rl.checkpoint.state import Component, load_component, save_component
from hybrid_rl.utils.faults import maybe_die

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class Checkpointer:
    """Saves to and resumes from `root`.

    Every public method except `latest_complete` is collective: all ranks call it, with the same
    step and component names. `root` must be one filesystem seen by all ranks.
    """

    def __init__(self, root: str | Path, *, keep_last: int, rank: int, world: int):
        if keep_last < 1:
            raise ValueError(f"checkpoint keep_last={keep_last} must be >= 1 (the number of complete checkpoints "
                             "kept on disk); set a large value to keep them all")
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self.world = world

    # ---- save ----------------------------------------------------------------------------------

    def save(self, step: int, *, components: dict[str, Component], rank_state: dict[str, Any],
             shared_state: dict[str, Any]) -> Path:
        """Write `root/step_<step>/` atomically and return it; raise CheckpointError on every rank on failure.

        On failure the partial `.tmp` directory is removed and older checkpoints are untouched.
        """
        _check_names(components)
        final, tmp = layout.step_dir(self.root, step), layout.tmp_dir(self.root, step)
        what = f"saving checkpoint step {step} to"
        self._agree(self._on_rank0(self._prepare, tmp), what, tmp)
        error = None
        try:
            self._write(tmp, components, rank_state, shared_state)
        except CAUGHT as e:
            error = e
        maybe_die("checkpoint_write", step)  # fault-injection tests only (HYBRID_RL_FAULT)
        self._agree(error, what, tmp)
        self._agree(self._on_rank0(self._commit, step, tmp, final, components), what, tmp)
        if self.rank == 0:
            self._prune()
            log.info("saved checkpoint %s", final)
        barrier(self.world)  # nobody moves on (or exits) before the checkpoint is published
        return final

    def _prepare(self, tmp: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in sorted(self.root.glob("step_*.tmp")):
            log.warning("removing %s, left behind by a save that did not finish", stale)
            shutil.rmtree(stale)
        tmp.mkdir()

    def _write(self, tmp: Path, components: dict[str, Component], rank_state: dict[str, Any],
               shared_state: dict[str, Any]) -> None:
        """This rank's part: DCP shards (collective), then its own files, then its done marker."""
        for name, (model, optimizer) in components.items():
            save_component(tmp / name, model, optimizer, single=not is_distributed(self.world))
        write_durable(tmp / layout.rank_file(self.rank), torch_bytes(rank_state))
        if self.rank == 0:
            write_durable(tmp / layout.SHARED, torch_bytes(shared_state))
        # The marker lists this rank's files as it wrote them; rank 0 checks it sees the same sizes
        # (on a network filesystem a file can lag behind for other clients).
        mine = [layout.rank_file(self.rank)] + [f"{n}/{f.name}" for n in components
                                                 for f in (tmp / n).glob(f"__{self.rank}_*")]
        if self.rank == 0:
            mine += [layout.SHARED] + [f"{n}/.metadata" for n in components]
        sizes = {rel: (tmp / rel).stat().st_size for rel in mine}
        write_durable(tmp / layout.done_marker(self.rank), json.dumps(sizes).encode())

    def _commit(self, step: int, tmp: Path, final: Path, components: dict[str, Component]) -> None:
        files = layout.scan_files(tmp)
        for r in range(self.world):
            marker = tmp / layout.done_marker(r)
            if not marker.is_file():
                raise CheckpointError(f"rank {r} left no {marker.name} marker")
            for rel, size in json.loads(marker.read_text()).items():
                if files.get(rel) != size:
                    raise CheckpointError(f"rank {r} wrote {rel} with {size} bytes; rank 0 sees {files.get(rel)}")
        manifest = layout.Manifest(step=step, world=self.world, files=files,
                                   components={n: opt is not None for n, (_, opt) in components.items()})
        write_durable(tmp / layout.COMPLETE, manifest.to_json().encode())
        fsync_dir(tmp)
        replace_dir(tmp, final)

    def _prune(self) -> None:
        """Delete complete checkpoints older than the newest `keep_last` (rank 0, after a commit).

        Never raises: the new checkpoint is committed, and a leftover old one only costs disk (while
        raising here, on rank 0 alone, would leave the other ranks waiting in the final barrier).
        """
        try:
            complete = [p for p in layout.candidates(self.root) if layout.problem(p) is None]
            for old in complete[self.keep_last:]:
                # Renamed first: a crash mid-delete leaves a *.tmp (ignored, then cleaned), not half a checkpoint.
                shutil.rmtree(old.rename(old.with_name(old.name + ".deleting.tmp")))
                log.info("removed old checkpoint %s (keep_last=%d)", old, self.keep_last)
        except OSError as e:
            log.warning("could not prune old checkpoints in %s: %s", self.root, e)

    def _agree(self, error: BaseException | None, what: str, tmp: Path) -> None:
        try:
            raise_if_any_failed(error, rank=self.rank, world=self.world, what=what, path=tmp)
        except CheckpointError:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _on_rank0(self, fn: Callable[..., None], *args: Any) -> BaseException | None:
        """Run `fn` on rank 0 only; return its exception instead of raising (the ranks agree on it next)."""
        if self.rank != 0:
            return None
        try:
            fn(*args)
        except CAUGHT as e:
            return e
        return None

    # ---- load ----------------------------------------------------------------------------------

    def latest_complete(self) -> Path | None:
        """The newest complete, intact checkpoint under `root` (this rank's view; no collectives)."""
        return self._newest_valid(skipped=set())

    def _newest_valid(self, skipped: set[Path]) -> Path | None:
        for path in layout.candidates(self.root):
            if path in skipped:
                continue
            if (reason := layout.problem(path)) is None:
                return path
            log.warning("skipping checkpoint %s: %s", path, reason)
            skipped.add(path)
        return None

    def load(self, path: str | Path, *, components: dict[str, Component]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Collective: restore `components` in place from `path`; returns (rank_state, shared_state)."""
        _, rank_state, shared_state = self._load(Path(path), components)
        return rank_state, shared_state

    def resume_auto(self, components: dict[str, Component]) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """Collective: restore the newest loadable checkpoint -> (step, rank_state, shared_state), or None
        when there is none. Partial or damaged checkpoints are skipped with a warning, newest first."""
        skipped: set[Path] = set()
        failures = []
        while (path := decide_on_rank0(lambda: self._newest_valid(skipped), rank=self.rank, world=self.world,
                                       what=f"looking for checkpoints in {self.root}")) is not None:
            try:
                manifest, rank_state, shared_state = self._load(path, components)
            except CheckpointError as e:
                if self.rank == 0:
                    log.warning("skipping checkpoint %s: %s", path, e)
                skipped.add(path)
                failures.append(str(e))
                continue
            if self.rank == 0:
                log.info("resumed from %s (step %d)", path, manifest.step)
            return manifest.step, rank_state, shared_state
        if failures:  # DCP loads in place: a load that failed half-way has already changed the model
            raise CheckpointError(f"no checkpoint under {self.root} could be loaded, and a failed load may have "
                                  f"partly overwritten the model and optimizer ({'; '.join(failures)}); move the "
                                  "damaged checkpoints away (or the whole directory, to start fresh) and relaunch")
        return None

    def _load(self, path: Path, components: dict[str, Component]) -> tuple[layout.Manifest, Any, Any]:
        reason, manifest = decide_on_rank0(lambda: _inspect(path), rank=self.rank, world=self.world,
                                           what=f"checking checkpoint {path}")
        if reason is not None:
            raise CheckpointError(f"cannot load checkpoint {path}: {reason}")
        _check_compatible(manifest, components, path, world=self.world)
        error = rank_state = shared_state = None
        try:
            for name, (model, optimizer) in components.items():
                load_component(path / name, model, optimizer, single=not is_distributed(self.world))
            rank_state = torch_read(path / layout.rank_file(self.rank))
            shared_state = torch_read(path / layout.SHARED)
        except CAUGHT as e:
            error = e
        raise_if_any_failed(error, rank=self.rank, world=self.world, what="loading checkpoint", path=path)
        return manifest, rank_state, shared_state


def _inspect(path: Path) -> tuple[str | None, layout.Manifest | None]:
    """(why not to load `path`, or None; its manifest when it is fine)."""
    reason = layout.problem(path)
    return reason, None if reason else layout.read_manifest(path)


def _check_names(components: dict[str, Component]) -> None:
    for name in components:
        if not _NAME.match(name):
            raise ValueError(f"checkpoint component name {name!r} becomes a directory name: use letters, digits, "
                             "'_' or '-' only (e.g. 'policy', 'critic')")


def _check_compatible(manifest: layout.Manifest, components: dict[str, Component], path: Path, *, world: int) -> None:
    """User errors, raised identically on every rank (all see the same broadcast manifest)."""
    if manifest.world != world:
        raise ValueError(f"checkpoint {path} was saved by {manifest.world} ranks but this run has {world}: its "
                         f"per-rank state (RNG, data position) cannot be split or merged; relaunch with "
                         f"{manifest.world} ranks")
    for name, (_, optimizer) in components.items():
        if name not in manifest.components:
            raise ValueError(f"checkpoint {path} has no component {name!r} (it holds {sorted(manifest.components)}); "
                             "pass the same component names to load() as to save()")
        if optimizer is not None and not manifest.components[name]:
            raise ValueError(f"checkpoint {path} saved no optimizer state for {name!r}; pass (model, None) for it")
