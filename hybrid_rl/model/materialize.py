"""Fill a model built on the meta device and FSDP2-sharded: each rank reads only its own rows.

The trainer never holds a whole model on a rank. `build/` builds the module with
`loading.empty_model` (parameters on the meta device), wraps it (LoRA, activation checkpointing),
shards it with `dist.fsdp.shard_model`, and then calls `materialize`, which

1. allocates this rank's shards on `device` (`to_empty`, FSDP2's way to leave the meta device) in
   the dtype the model was built in, and puts back the buffers the modules computed themselves
   (rotary `inv_freq`: in no checkpoint, and `to_empty` leaves garbage);
2. reads, for every parameter, rows [a, b) of its checkpoint tensor (`dist.fsdp.local_rows`,
   FSDP2's Shard(0)) straight into the local shard, at most `chunk_bytes` at a time, cast to the
   shard's dtype;
3. initialises the parameters no checkpoint has, identically whatever the world size: each rank
   builds the whole (small) tensor from a generator seeded by `seed` and the parameter's name, and
   keeps its rows. LoRA B: zeros, LoRA A: kaiming-uniform(a=sqrt(5)) (as peft); a classification
   head (critic, reward model): normal(0, initializer_range), bias zeros (as transformers).

A parameter its family fuses from several checkpoint tensors (a mixture of experts' `experts.gate_up_proj`
[E, 2I, H], stored as one `experts.<e>.gate_proj.weight` / `up_proj.weight` per expert: `model.families`) is
filled the way transformers fuses it when it loads, one expert at a time: a rank reads only the experts its
rows of dim 0 hold.

A checkpoint that lacks any other parameter is an error, not a random initialisation.
"""

from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass, field

import torch
from torch import nn

from hybrid_rl.distributed.fsdp import local_rows, local_tensor
from hybrid_rl.model.families import ExpertPiece, FusedNames
from hybrid_rl.model.lora import hf_name
from hybrid_rl.model.weight_files import WeightFiles

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 8 * 2**20  # the most of one tensor read at a time (the planner's start-up buffer)
_HEADS = ("ForTokenClassification", "ForSequenceClassification")  # their head is new over a causal LM


@dataclass
class LoadReport:
    """What one rank read and made."""

    bytes_read: int = 0  # checkpoint bytes read (this rank's rows, as stored)
    largest_read: int = 0  # the largest single read
    loaded: int = 0  # parameters filled from the checkpoint
    initialised: list[str] = field(default_factory=list)  # parameters the checkpoint lacks, initialised here


@torch.no_grad()
def materialize(model: nn.Module, path: str, *, device: torch.device | str, seed: int = 0,
                chunk_bytes: int = READ_CHUNK_BYTES) -> LoadReport:
    """Allocate this rank's shards of `model` on `device` and fill them from the checkpoint folder `path`."""
    buffers = dict(model.named_buffers())  # real CPU tensors, computed by the modules at construction
    if meta := [n for n, b in buffers.items() if b.is_meta]:
        raise ValueError(f"buffers {meta[:3]} are on the meta device: build the model with loading.empty_model, "
                         "which computes buffers for real")
    _to_empty_once(model, torch.device(device))
    for name, buf in model.named_buffers():
        buf.copy_(buffers[name])
    hf = _hf_model(model)
    prefix = getattr(hf, "base_model_prefix", "")
    init_range = getattr(hf.config, "initializer_range", None) or 0.02
    aliases = _aliases(model)
    report, missing = LoadReport(), []
    files = WeightFiles(path)
    fused = FusedNames(hf.config)
    for p in model.parameters():
        names = [hf_name(n) for n in aliases[id(p)]]
        key = next((k for n in names for k in _candidates(n, prefix) if k in files), None)
        pieces = None if key is not None or not fused else next(
            (pcs for n in names for k in _candidates(n, prefix) if (pcs := fused.pieces(k))
             and all(pc.name in files for pc in pcs)), None)
        if key is not None:
            _load_rows(files, key, p, chunk_bytes, report)
        elif pieces is not None:
            _load_experts(files, pieces, p, chunk_bytes, report)
        elif _initialise(names[0], p, hf, prefix, seed, init_range):
            report.initialised.append(names[0])
        else:
            missing.append(names[0])
    if missing:
        raise ValueError(f"{path}: the checkpoint has no tensor for {len(missing)} parameter(s) of "
                         f"{type(hf).__name__}, e.g. {', '.join(missing[:5])}")
    if report.initialised:
        lora = sum(".lora_" in n for n in report.initialised)
        heads = [n for n in report.initialised if ".lora_" not in n]
        log.info("%s: %d LoRA parameters initialised%s", path, lora,
                 f"; new head (not in the checkpoint): {', '.join(heads)}" if heads else "")
    return report


def _to_empty_once(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device=device)`, allocating a tied weight once.

    `to_empty` allocates a tensor for every module's registration of a parameter, and a tied head is
    registered twice (embedding and head): the second allocation replaces the first, so start-up
    briefly holds two copies of the largest weight of a small model (0.25 GiB of bf16 at Qwen2.5-0.5B's
    shape, seen on an H100 above the memory plan). A tensor already on `device` is kept as it is.
    (`_apply` is what `to_empty` calls; FSDP2 overrides it to re-register its shards afterwards.)
    """
    def there(t: torch.Tensor) -> bool:
        return t.device.type == device.type and device.index in (None, t.device.index)

    model._apply(lambda t: t if there(t) else torch.empty_like(t, device=device))


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    inner = getattr(getattr(model, "base_model", None), "model", None)
    return inner if inner is not None and hasattr(model, "peft_config") else model


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter (a tied head is also the embedding), first name first."""
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def _candidates(name: str, prefix: str) -> list[str]:
    """Checkpoint keys that may hold HF parameter `name`: as is, or saved from/for the bare backbone."""
    keys = [name]
    if prefix and name.startswith(prefix + "."):
        keys.append(name[len(prefix) + 1:])
    elif prefix:
        keys.append(f"{prefix}.{name}")
    return keys


def _load_rows(files: WeightFiles, key: str, p: nn.Parameter, chunk_bytes: int, report: LoadReport) -> None:
    if files.shape(key) != tuple(p.shape):
        raise ValueError(f"checkpoint tensor {key} has shape {files.shape(key)}, the model expects {tuple(p.shape)}")
    a, b = local_rows(p)
    local = local_tensor(p)
    step = max(1, chunk_bytes // max(1, files.row_bytes(key)))
    for i in range(a, b, step):
        j = min(i + step, b)
        block = files.rows(key, i, j)
        local[i - a: j - a].copy_(block)
        report.bytes_read += block.nbytes
        report.largest_read = max(report.largest_read, block.nbytes)
    report.loaded += 1


def _load_experts(files: WeightFiles, pieces: list[ExpertPiece], p: nn.Parameter, chunk_bytes: int,
                  report: LoadReport) -> None:
    """Fill this rank's experts (rows [a, b) of dim 0) of a fused parameter from their per-expert tensors."""
    a, b = local_rows(p)
    local = local_tensor(p)
    for pc in pieces:
        want = (pc.rows, *p.shape[2:])
        if files.shape(pc.name) != want:
            raise ValueError(f"checkpoint tensor {pc.name} has shape {files.shape(pc.name)}, the model expects {want}")
        if not a <= pc.expert < b:
            continue
        step = max(1, chunk_bytes // max(1, files.row_bytes(pc.name)))
        for i in range(0, pc.rows, step):
            j = min(i + step, pc.rows)
            block = files.rows(pc.name, i, j)
            local[pc.expert - a, pc.offset + i: pc.offset + j].copy_(block)
            report.bytes_read += block.nbytes
            report.largest_read = max(report.largest_read, block.nbytes)
    report.loaded += 1


def _initialise(name: str, p: nn.Parameter, hf: nn.Module, prefix: str, seed: int, init_range: float) -> bool:
    """Initialise a parameter no checkpoint holds; False if it is not one that may be new."""
    is_head = type(hf).__name__.endswith(_HEADS) and not name.startswith(prefix + ".")
    zeros = ".lora_B." in name or (is_head and name.endswith(".bias"))
    if not (zeros or ".lora_A." in name or (is_head and p.dim() == 2)):
        return False
    a, b = local_rows(p)
    local = local_tensor(p)
    if zeros:
        local.zero_()
    else:
        local.copy_(initial_value(name, tuple(p.shape), seed=seed, init_range=init_range)[a:b])
    return True


def _generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator that depends on the run's seed and the parameter's name only."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def initial_value(name: str, shape: tuple[int, ...], *, seed: int, init_range: float = 0.02) -> torch.Tensor:
    """The whole float32 tensor `materialize` gives a new 2-D parameter `name`: LoRA A or a head's weight."""
    full = torch.empty(shape, dtype=torch.float32)
    if ".lora_A." in name:
        return nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=_generator(seed, name))
    return full.normal_(0.0, init_range, generator=_generator(seed, name))
