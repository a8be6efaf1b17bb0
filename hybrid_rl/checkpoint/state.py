"""One component (a model and its optimizer) to and from a DCP directory, sharded: no rank gathers anything.

`get_state_dict` returns the FSDP2 parameters and optimizer moments as DTensors; DCP writes each
rank's local shards to its own file and records the global layout in `.metadata`, so a checkpoint
can also be read back by a different number of ranks (the per-rank state cannot; see Checkpointer).
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


def save_component(directory: Path, model: nn.Module, optimizer: Optimizer | None, *, single: bool) -> None:
    """Collective (unless `single`, a world of one): every rank writes its shards under `directory`.

    DCP itself gathers every rank's write errors and raises the same exception on all of them.
    """
    with _expected_single_process(single):
        dcp.save(component_state(model, optimizer), checkpoint_id=directory, no_dist=single)


def load_component(directory: Path, model: nn.Module, optimizer: Optimizer | None, *, single: bool) -> None:
    """Collective (unless `single`): read `directory` into the model (and optimizer) in place, strictly."""
    state = component_state(model, optimizer)
    with _expected_single_process(single):
        dcp.load(state, checkpoint_id=directory, no_dist=single)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


@contextmanager
def _expected_single_process(single: bool) -> Iterator[None]:
    """DCP warns on every call without a process group; for a world of one that is the intent."""
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
