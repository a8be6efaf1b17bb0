"""Export the (FSDP2-sharded) policy as a Hugging Face folder that `from_pretrained` and vLLM load.

All ranks gather the full state dict to rank 0's CPU (one collective); rank 0 writes safetensors,
config, generation config and tokenizer into `<out>.tmp/` and renames it to `<out>/` when done, so
a crash never leaves a half-written model folder that looks loadable.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hybrid_rl.checkpoint.collective import CAUGHT, raise_if_any_failed
from hybrid_rl.checkpoint.files import fsync_tree, replace_dir
from hybrid_rl.dist.collectives import world_size
from hybrid_rl.dist.fsdp import hf_name


def export_hf(model: nn.Module, tokenizer: Any, out_dir: str | Path, *, rank: int, dtype: torch.dtype | None = None,
              max_shard_bytes: int = 5 * 1024**3,
              transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
              after: Callable[[dict[str, torch.Tensor], Path], None] | None = None) -> Path:
    """Collective: write `model` (+ `tokenizer`, if not None) as an HF folder at `out_dir`; returns it.

    `dtype` casts the weights (and the config's dtype), e.g. bfloat16 for serving; None keeps them as
    trained. Weights over `max_shard_bytes` are split into indexed shards, as `save_pretrained` does.
    `transform` maps the gathered state dict to the one written (e.g. merging a LoRA adapter), and
    `after(full, tmp_dir)` may add files to the folder before it is published (rank 0 only).
    """
    out = Path(out_dir)
    hf_model = _hf_model(model)  # a ValueError here is raised by every rank alike
    world = world_size()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)  # rank 0 holds everything, on CPU; others nothing
    error = None
    if rank == 0:
        try:
            hook = functools.partial(after, full) if after else None
            _write_folder(hf_model, tokenizer, transform(full) if transform else full, out, dtype=dtype,
                          max_shard_bytes=max_shard_bytes, after=hook)
        except CAUGHT as e:
            error = e
            shutil.rmtree(out.with_name(out.name + ".tmp"), ignore_errors=True)
    del full
    raise_if_any_failed(error, rank=rank, world=world, what="exporting the model to", path=out)
    return out


def _write_folder(hf_model: nn.Module, tokenizer: Any, full: dict[str, torch.Tensor], out: Path, *,
                  dtype: torch.dtype | None, max_shard_bytes: int, after: Callable[[Path], None] | None = None) -> None:
    config = copy.deepcopy(hf_model.config)  # never mutate the live model's config
    tensors = hf_tensors(full, tied=_tied_names(hf_model), dtype=dtype)
    if dtype is not None:
        config.dtype = dtype
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():  # left by an export that crashed
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    _write_safetensors(tensors, tmp, max_shard_bytes=max_shard_bytes)
    config.save_pretrained(tmp)
    generation = getattr(hf_model, "generation_config", None)
    if generation is None:
        from transformers import GenerationConfig

        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if after is not None:
        after(tmp)
    fsync_tree(tmp)
    replace_dir(tmp, out)


def hf_tensors(full: dict[str, torch.Tensor], *, tied: set[str], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """HF names -> contiguous CPU tensors: wrapper prefixes stripped, tied copies (e.g. lm_head) dropped.

    Tied weights are written once, as HF does; `from_pretrained` re-ties them from the config.
    """
    out = {}
    for name, t in full.items():
        name = hf_name(name)
        if name in tied:
            continue
        t = t.detach()
        out[name] = (t if dtype is None else t.to(dtype)).contiguous()
    return out


def _tied_names(hf_model: nn.Module) -> set[str]:
    """Names that alias another weight under this config (transformers >= 5 lists only the active ties)."""
    tied = getattr(hf_model, "all_tied_weights_keys", None)
    if tied is not None:
        return set(tied)
    return {"lm_head.weight"} if getattr(hf_model.config, "tie_word_embeddings", False) else set()


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside any wrappers (the first module carrying a `config` with `save_pretrained`)."""
    for m in model.modules():
        if hasattr(getattr(m, "config", None), "save_pretrained"):
            return m
    raise ValueError(f"export_hf: {type(model).__name__} contains no Hugging Face model (no module with a "
                     "`config`); pass the transformers model (FSDP-wrapped is fine)")


def _write_safetensors(tensors: dict[str, torch.Tensor], out: Path, *, max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}  # transformers expects it in the safetensors header
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / fname, metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
