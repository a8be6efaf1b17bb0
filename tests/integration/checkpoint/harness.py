"""Real gloo ranks for the checkpoint tests: start them, an FSDP2-sharded tiny model, a train step, snapshots.

Each test module runs its whole scenario in one start of the ranks (starting them costs seconds on
2 cores) and records what it saw; the test functions then assert one behaviour each on that record.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from hybrid_rl.distributed.fsdp import local_tensor, shard_model
from hybrid_rl.distributed.mesh import free_port

Snapshot = dict[str, torch.Tensor]


def spawn(scenario: Callable[..., None], *args: Any, world: int = 2) -> dict:
    """Run `scenario(rank, world, results, *args)` on `world` gloo ranks; return {rank: what it recorded}.

    The ranks are forked, not spawned as in weightsync/test_reshard.py: a spawned rank re-imports torch
    and transformers (~5-10 s per rank on 2 shared cores), a forked one inherits them. Fork is safe
    here because the parent holds no process group, no accelerator context and (after stopping
    tqdm's monitor) no other thread; should another thread be running, this falls back to spawn.
    """
    _stop_tqdm_monitor()
    start_method = "fork" if threading.active_count() == 1 else "spawn"
    results = mp.Manager().dict()
    mp.start_processes(_run, args=(scenario, world, free_port(), results, args), nprocs=world, join=True,
                       start_method=start_method)
    return {r: results[r] for r in range(world)}


def _stop_tqdm_monitor() -> None:
    """HF progress bars start tqdm's monitor thread; a fork while it holds tqdm's lock would hang the child."""
    from tqdm import tqdm
    from tqdm._monitor import TMonitor

    tqdm.monitor_interval = 0  # inherited by tqdm.auto's class: no new monitor threads
    for thread in threading.enumerate():
        if isinstance(thread, TMonitor):
            thread.exit()


def _run(rank: int, scenario: Callable[..., None], world: int, port: int, results, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A short timeout turns a deadlock (one rank raised, the other waits) into a failure, not a hang.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    record: dict[str, Any] = {}
    try:
        scenario(rank, world, record, *args)
    except BaseException:
        record["crash"] = traceback.format_exc()
        raise
    finally:
        results[rank] = record
    dist.destroy_process_group()


def sharded_model(model_dir: str, world: int, shard: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The tiny HF model, FSDP2-sharded over a 1-D mesh of all ranks (`shard` 0), or HSDP over a 2-D mesh
    (replicate x `shard`, as `trainer.shard_size`), with AdamW (float32 throughout)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard")) if shard \
        else init_device_mesh("cpu", (world,))
    shard_model(model, mesh, param_dtype=torch.float32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(seed: int, vocab: int = 400) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> torch.Tensor:
    """One AdamW step on this rank's batch (`seed`); its loss."""
    ids = batch(seed)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Snapshot:
    """Clones of this rank's parameter shards and optimizer state (moments, step counters, learning rates)."""
    snap = {f"param/{n}": local_tensor(p).detach().clone() for n, p in model.named_parameters()}
    snap["optim/lr"] = torch.tensor([g["lr"] for g in optimizer.param_groups], dtype=torch.float64)
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for k, v in state.items():
            snap[f"optim/{names[id(p)]}/{k}"] = local_tensor(v).detach().clone()
    return snap


def bitwise_equal(a: Snapshot, b: Snapshot) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Captured(logging.Handler):
    """Collects the warnings of `hybrid_rl.checkpoint` in this process."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("hybrid_rl.checkpoint").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
