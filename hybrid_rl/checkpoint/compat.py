"""Whether a checkpoint belongs to this run: its saved config against the current one, its tensors against the model.

A resume loads whatever the output folder holds. A checkpoint of another model or algorithm (a reused folder, a
folder copied from a colleague) is refused with what differs, as a user error, before anything is loaded; a
mismatch of tensor shapes is said as such, not as "damaged checkpoints". Keys that a relaunch may change (steps,
paths, save cadence, logging, timeouts, performance knobs) pass silently; any other changed setting is listed
in one warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

from hybrid_rl.checkpoint import layout
from hybrid_rl.checkpoint.collective import CheckpointError
from hybrid_rl.checkpoint.untrusted import UnsafeCheckpointError, read_state
from hybrid_rl.errors import EXIT_BAD_INPUT

# A change here is another run: its weights, optimizer state or data order mean something else.
IDENTITY = ("model.lora.rank", "model.lora.alpha", "model.lora.target_modules", "algorithm.name",
            "algorithm.advantage", "algorithm.objective", "algorithm.use_critic", "optim.name")
# Compared by the folder's name only: the same model moved to another path is the same model.
MODEL_PATHS = ("model.path", "critic.path", "reward.model_path")
# Free to change on a relaunch (prefixes of dotted keys).
MAY_CHANGE = ("trainer.total_steps", "trainer.output_dir", "trainer.save_every", "trainer.keep_last",
              "trainer.resume", "trainer.val_every", "trainer.show_progress", "trainer.export", "trainer.memory_check",
              "trainer.max_bad_steps", "trainer.max_logprob_diff", "trainer.micro_batch_tokens", "data.train_files",
              "data.val_files", "data.val_prompts", "offload.", "sidecar.", "reward.num_workers", "reward.timeout_s",
              "rollout.verify", "rollout.bucket_mb", "rollout.kv_cache_gb", "rollout.gpu_memory_utilization",
              "rollout.enforce_eager", "rollout.release", "rollout.cpu_packed_linears", "rollout.tp",
              "rollout.multi_turn.tool_workers", "rollout.multi_turn.tool_timeout_s", "rollout.multi_turn.schedule")


class IncompatibleCheckpoint(CheckpointError):
    """The checkpoint was written for another model or algorithm: a user error (exit 2), never skipped."""

    exit_code = EXIT_BAD_INPUT


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same(key: str, saved: Any, now: Any) -> bool:
    if key in MODEL_PATHS and saved and now:
        return PurePath(str(saved).rstrip("/")).name == PurePath(str(now).rstrip("/")).name
    if isinstance(saved, list | tuple) and isinstance(now, list | tuple):
        return list(saved) == list(now)
    return saved == now


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(differences that make it another run, other changed settings), each as 'key: saved -> now'."""
    before, after = flatten(saved), flatten(current)
    fatal, changed = [], []
    for key in sorted(set(before) | set(after)):
        if key not in before or key not in after:  # a key of another version of the config: not comparable
            continue
        if _same(key, before[key], after[key]) or key.startswith(MAY_CHANGE):
            continue
        (fatal if key in IDENTITY or key in MODEL_PATHS else changed).append(f"{key}: {before[key]!r} -> "
                                                                             f"{after[key]!r}")
    return fatal, changed


def check_resume(checkpoints: Path, current: Mapping[str, Any], *, rank: int) -> list[str]:
    """Before a resume: raise IncompatibleCheckpoint when the newest intact checkpoint under `checkpoints` was
    written for another model or algorithm; return the other settings that changed (for one warning)."""
    newest = next((p for p in layout.candidates(checkpoints) if layout.problem(p, rank) is None), None)
    if newest is None:
        return []
    try:
        saved = read_state(newest / layout.SHARED).get("config")
    except UnsafeCheckpointError:
        raise
    except (CheckpointError, OSError, RuntimeError, AttributeError):  # damaged: the resume skips it and says why
        return []
    if not isinstance(saved, Mapping):
        return []
    fatal, changed = config_differences(saved, current)
    if fatal:
        raise IncompatibleCheckpoint(
            f"the checkpoint {newest} was written by a run of another model or algorithm ({'; '.join(fatal)}): "
            "resume it with its own settings, or give this run another trainer.output_dir (or trainer.resume=never "
            "to start afresh there)")
    return changed


def shape_mismatches(saved: Mapping[str, Any], current: Mapping[str, Any], *, component: str) -> list[str]:
    """The model tensors whose saved shape (DCP metadata: 'model.<name>' -> its storage metadata) differs from the
    current model's, or that the checkpoint lacks."""
    out = []
    for name, tensor in current.items():
        meta = saved.get(f"model.{name}")
        size = getattr(meta, "size", None)
        if meta is None:
            out.append(f"{component}: {name} is not in the checkpoint")
        elif size is not None and tuple(size) != tuple(tensor.shape):
            out.append(f"{component}: {name} was saved as {list(size)}, this model's is {list(tensor.shape)}")
        elif (held := _uncovered(meta, tensor)) is not None:
            out.append(f"{component}: {name}: this rank holds {held} of it, which this rank's files do not (the "
                       "checkpoint was written with a larger trainer.shard_size: resume with the one it was written "
                       "with)")
    return out


def _uncovered(meta: Any, tensor: Any) -> str | None:
    """The block of `tensor` this rank holds, where no chunk this rank saved contains it (each rank reads only its own
    files, and DCP would leave the rest as it was); None where one does (or the metadata does not tell)."""
    chunks = getattr(meta, "chunks", None)
    if not chunks or tensor.numel() == 0:
        return None
    if hasattr(tensor, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    else:
        sizes, offsets = tuple(tensor.shape), (0,) * tensor.dim()
    if any(all(c <= o and o + s <= c + cs for o, s, c, cs in zip(offsets, sizes, ch.offsets, ch.sizes, strict=True))
           for ch in chunks):
        return None
    return "rows " + ":".join(map(str, (offsets[0], offsets[0] + sizes[0]))) if sizes else "its value"
