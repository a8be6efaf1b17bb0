"""Checkpointer: atomic, sharded saves of the training state, and a resume that never loads a partial one.

Saving is collective and goes in three agreed phases, each closed by one all-gather of the ranks'
errors, so a failure on any rank becomes the same `CheckpointError` on all of them (no rank is left
in a barrier) and nothing is published:

1. each filesystem's leader (rank 0 when all ranks share one; `sites.py`) removes stale `*.tmp` directories and
   creates `step_<n>.tmp/`;
2. every rank writes its own DCP folder per component, its `rank<r>.pt` and a `done.rank<r>` marker listing its
   files with their sizes (each leader also `shared.pt`, rank 0's);
3. each leader checks the markers of the ranks on its filesystem against what it sees there, writes the
   `COMPLETE` manifest and renames `step_<n>.tmp/` to `step_<n>/`; then it prunes to the newest `keep_last`.

Loading is agreed the same way: every rank checks its own copy, and all load the newest checkpoint that every
rank found intact. See `layout.py` for the directory format.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict import get_model_state_dict

from hybrid_rl.checkpoint import layout
from hybrid_rl.checkpoint.collective import (
    CAUGHT,
    CheckpointError,
    barrier,
    broadcast_from_rank0,
    gather_errors,
    is_distributed,
    raise_if_any_failed,
)
from hybrid_rl.checkpoint.compat import IncompatibleCheckpoint, shape_mismatches
from hybrid_rl.checkpoint.files import fsync_dir, replace_dir, torch_bytes, write_durable
from hybrid_rl.checkpoint.sites import Site, find_site
from hybrid_rl.checkpoint.state import Component, load_component, rank_dir, save_component
from hybrid_rl.checkpoint.untrusted import DCP_METADATA, UnsafeCheckpointError, read_dcp_metadata, read_state
from hybrid_rl.distributed import collectives
from hybrid_rl.utils.faults import maybe_die

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class Checkpointer:
    """Saves to and resumes from `root`.

    Every public method except `latest_complete` is collective: all ranks call it, with the same
    step and component names. `root` is one filesystem seen by all ranks, or one per node (each node's ranks
    see theirs): the ranks find out at the first save or load.
    """

    def __init__(self, root: str | Path, *, keep_last: int, rank: int, world: int):
        if keep_last < 1:
            raise ValueError(f"checkpoint keep_last={keep_last} must be >= 1 (the number of complete checkpoints "
                             "kept on disk); set a large value to keep them all")
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self.world = world
        self._site: Site | None = None
        self._misplaced: list[str] = []  # copies found holding other ranks' files (node-local folders, ranks moved)

    def site(self) -> Site:
        """Collective at the first call: the ranks that share this rank's checkpoint filesystem."""
        if self._site is None:
            self._site = find_site(self.root, rank=self.rank, world=self.world)
        return self._site

    # ---- save ----------------------------------------------------------------------------------

    def save(self, step: int, *, components: dict[str, Component], rank_state: dict[str, Any],
             shared_state: dict[str, Any]) -> Path:
        """Write `root/step_<step>/` atomically and return it; raise CheckpointError on every rank on failure.

        On failure the partial `.tmp` directory is removed and older checkpoints are untouched.
        """
        _check_names(components)
        site = self.site()
        final, tmp = layout.step_dir(self.root, step), layout.tmp_dir(self.root, step)
        what = f"saving checkpoint step {step} to"
        self._agree(self._on_leader(self._prepare, tmp), what, tmp)
        if not site.shared:  # every filesystem gets rank 0's shared state (the same on all ranks, by contract)
            shared_state = broadcast_from_rank0(shared_state, world=self.world)
        error = None
        try:
            self._write(tmp, components, rank_state, shared_state)
        except CAUGHT as e:
            error = e
        maybe_die("checkpoint_write", step)  # fault-injection tests only (HYBRID_RL_FAULT)
        self._agree(error, what, tmp)
        self._agree(self._on_leader(self._commit, step, tmp, final, components), what, tmp)
        if self.rank == site.leader:
            self._prune()
            log.info("saved checkpoint %s%s", final, "" if site.shared else f" (ranks {list(site.ranks)})")
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
        """This rank's part: its DCP folder per component, then its own files, then its done marker."""
        leader = self.rank == self.site().leader
        for name, (model, optimizer) in components.items():
            save_component(tmp / name, model, optimizer, rank=self.rank)
        write_durable(tmp / layout.rank_file(self.rank), torch_bytes(rank_state))
        if leader:
            write_durable(tmp / layout.SHARED, torch_bytes(shared_state))
        # The marker lists this rank's files as it wrote them; the leader checks it sees the same sizes
        # (on a network filesystem a file can lag behind for other clients).
        mine = [layout.rank_file(self.rank)] + [f"{n}/{f.relative_to(tmp / n).as_posix()}" for n in components
                                                 for f in sorted(rank_dir(tmp / n, self.rank).rglob("*"))
                                                 if f.is_file()]
        if leader:
            mine.append(layout.SHARED)
        sizes = {rel: (tmp / rel).stat().st_size for rel in mine}
        write_durable(tmp / layout.done_marker(self.rank), json.dumps(sizes).encode())

    def _commit(self, step: int, tmp: Path, final: Path, components: dict[str, Component]) -> None:
        """On each filesystem's leader: every rank of that filesystem finished, and what they wrote is all there."""
        files = layout.scan_files(tmp)
        ranks = self.site().ranks
        for r in ranks:
            marker = tmp / layout.done_marker(r)
            if not marker.is_file():
                raise CheckpointError(f"rank {r} left no {marker.name} marker")
            for rel, size in json.loads(marker.read_text()).items():
                if files.get(rel) != size:
                    raise CheckpointError(f"rank {r} wrote {rel} with {size} bytes; rank {self.rank} sees "
                                          f"{files.get(rel)}")
        manifest = layout.Manifest(step=step, world=self.world, files=files, ranks=ranks,
                                   components={n: opt is not None for n, (_, opt) in components.items()})
        write_durable(tmp / layout.COMPLETE, manifest.to_json().encode())
        fsync_dir(tmp)
        replace_dir(tmp, final)

    def _prune(self) -> None:
        """Delete complete checkpoints older than the newest `keep_last` (each filesystem's leader, after a commit).

        Never raises: the new checkpoint is committed, and a leftover old one only costs disk (while
        raising here, on one rank alone, would leave the other ranks waiting in the final barrier).
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
            if self.rank == self.site().leader:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _on_leader(self, fn: Callable[..., None], *args: Any) -> BaseException | None:
        """Run `fn` on this filesystem's leader only; return its exception instead of raising (the ranks agree on
        it next)."""
        if self.rank != self.site().leader:
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
        for path in self._valid(skipped):
            return path
        return None

    def _valid(self, skipped: set[Path]) -> Iterator[Path]:
        """This rank's intact checkpoints, newest first (each found damaged is logged once and skipped)."""
        for path in layout.candidates(self.root):
            if path in skipped:
                continue
            if (reason := layout.problem(path, self.rank)) is None:
                yield path
                continue
            if reason.startswith(layout.OTHER_RANKS):
                self._misplaced.append(f"rank {self.rank}: {path}: {reason}")
            if self.rank == (self._site.leader if self._site else 0):  # said once per filesystem
                log.warning("skipping checkpoint %s: %s", path, reason)
            skipped.add(path)

    def _agreed_newest(self, skipped: set[Path]) -> Path | None:
        """Collective: the newest step that every rank found intact in its own copy (its path under this rank's
        root), or None. On one filesystem every rank sees the same copies; on node-local disks a save that
        committed on one node but not another is skipped."""
        self._misplaced = []
        steps = [int(p.name.split("_")[1]) for p in self._valid(skipped)]
        views = [(steps, self._misplaced)]
        if is_distributed(self.world):
            views = collectives.all_gather_object(views[0])
        misplaced = [m for _, ms in views for m in ms]
        if misplaced:  # resuming from nothing would silently throw the run away
            raise CheckpointError(
                f"a rank runs on a node whose checkpoints hold other ranks' files ({'; '.join(misplaced[:4])}). "
                "With node-local checkpoint folders every node must keep its ranks across restarts: torchrun's c10d "
                "rendezvous numbers nodes in the order of their addresses (--local-addr, else the host name), so "
                "relaunch on the same hosts (or use one filesystem that every node mounts)")
        common = set.intersection(*(set(s) for s, _ in views))
        if not common and any(s for s, _ in views):  # node-local folders whose saves never committed everywhere
            held = "; ".join(f"rank {r}: {sorted(s, reverse=True)[:3] or 'none'}" for r, (s, _) in enumerate(views))
            raise CheckpointError(f"no checkpoint step is intact on every rank (steps each rank holds: {held}); "
                                  "copy the missing step folders between the nodes' checkpoint folders, or move "
                                  "them all away to start afresh")
        return layout.step_dir(self.root, max(common)) if common else None

    def load(self, path: str | Path, *, components: dict[str, Component]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Collective: restore `components` in place from `path`; returns (rank_state, shared_state)."""
        self.site()
        _, rank_state, shared_state = self._load(Path(path), components)
        return rank_state, shared_state

    def resume_auto(self, components: dict[str, Component]) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """Collective: restore the newest loadable checkpoint -> (step, rank_state, shared_state), or None
        when there is none. Partial or damaged checkpoints are skipped with a warning, newest first."""
        self.site()
        skipped: set[Path] = set()
        failures = []
        while (path := self._agreed_newest(skipped)) is not None:
            try:
                manifest, rank_state, shared_state = self._load(path, components)
            except (UnsafeCheckpointError, IncompatibleCheckpoint):
                raise  # another run's or someone else's files: falling back to an older step would hide it
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
        # Every rank checks its own copy; all agree (one rank's damaged copy stops them all, with its reason).
        reason, manifest = _inspect(path, self.rank)
        errors = gather_errors(None if reason is None else f"rank {self.rank}: {reason}", world=self.world)
        if errors:
            raise CheckpointError(f"cannot load checkpoint {path}: {'; '.join(dict.fromkeys(errors.values()))}")
        _check_compatible(manifest, components, path, world=self.world)
        rank_state, shared_state = self._read_states(path, components)
        error = None
        try:
            for name, (model, optimizer) in components.items():
                load_component(path / name, model, optimizer, rank=self.rank)
        except CAUGHT as e:
            error = e
        raise_if_any_failed(error, rank=self.rank, world=self.world, what="loading checkpoint", path=path)
        return manifest, rank_state, shared_state

    def _read_states(self, path: Path, components: dict[str, Component]) -> tuple[Any, Any]:
        """Collective: this rank's state files, once every rank found its pickles to be data only and the saved
        tensors to fit the components. Checked before anything is loaded in place; a refusal or a mismatch is
        agreed on as an error that resume never skips (it is not damage: an older step would be no better)."""
        error = unsafe = states = None
        mismatches: list[str] = []
        try:
            for name, (model, _) in components.items():
                saved = read_dcp_metadata(rank_dir(path / name, self.rank) / DCP_METADATA).state_dict_metadata
                mismatches += shape_mismatches(saved, get_model_state_dict(model), component=name)
            states = read_state(path / layout.rank_file(self.rank)), read_state(path / layout.SHARED)
        except UnsafeCheckpointError as e:
            unsafe = f"rank {self.rank}: {e}"
        except CAUGHT as e:
            error = e
        if refused := gather_errors(unsafe, world=self.world):
            raise UnsafeCheckpointError(f"cannot load checkpoint {path}: {'; '.join(dict.fromkeys(refused.values()))}")
        if differ := gather_errors("; ".join(mismatches[:4]) or None, world=self.world):
            raise IncompatibleCheckpoint(
                f"the checkpoint {path} was written for another model ({'; '.join(dict.fromkeys(differ.values()))}"
                f"{'; ...' if len(mismatches) > 4 else ''}): resume with the model it was trained from, or give "
                "this run another trainer.output_dir")
        raise_if_any_failed(error, rank=self.rank, world=self.world, what="loading checkpoint", path=path)
        return states


def _inspect(path: Path, rank: int) -> tuple[str | None, layout.Manifest | None]:
    """(why `rank` must not load `path`, or None; its manifest when it is fine)."""
    reason = layout.problem(path, rank)
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
