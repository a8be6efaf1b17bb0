"""One component (a model and its optimizer) to and from DCP files, sharded: no rank gathers anything.

`get_state_dict` returns the FSDP2 parameters and optimizer moments as DTensors; each rank writes its own local
shards, and the metadata that describes them, to a folder of its own (`<component>/rank<r>/`, DCP without a
process group). A rank's folder is complete by itself: it never needs a file that another rank wrote, so a run
whose nodes each keep their checkpoints on a local disk can resume (a global DCP checkpoint keeps one
`.metadata`, on the coordinator's disk, and stores each replicated tensor once, in some rank's file). A
checkpoint is therefore read back by the same number of ranks, which the per-rank state (RNG, data position)
requires anyway (see Checkpointer).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from hybrid_rl.checkpoint.untrusted import SafeFileSystemReader

Component = tuple[nn.Module, Optimizer | None]


def component_state(model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    """{"model": ..., "optimizer": ...} of sharded tensors that alias the live ones (no copy).

    An optimizer that has not stepped yet gets its state created (a zero-lr step on zero grads),
    so that saving at step 0 and loading into a fresh optimizer both work.
    """
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def rank_dir(directory: Path, rank: int) -> Path:
    """Where rank `rank` keeps its part of a component."""
    return directory / f"rank{rank}"


def save_component(directory: Path, model: nn.Module, optimizer: Optimizer | None, *, rank: int) -> None:
    """This rank's shards of the component under `directory/rank<r>/`. Local: no collective (the Checkpointer
    agrees on every rank's errors afterwards)."""
    with _no_process_group():
        dcp.save(component_state(model, optimizer), checkpoint_id=rank_dir(directory, rank), no_dist=True)


def load_component(directory: Path, model: nn.Module, optimizer: Optimizer | None, *, rank: int) -> None:
    """Read this rank's shards from `directory/rank<r>/` into the model (and optimizer) in place, strictly."""
    state = component_state(model, optimizer)
    with _no_process_group():
        dcp.load(state, storage_reader=SafeFileSystemReader(rank_dir(directory, rank)), no_dist=True)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


@contextmanager
def _no_process_group() -> Iterator[None]:
    """DCP warns at every call made without its process group; each rank's own folder is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*no_dist.*", category=UserWarning)
        yield
