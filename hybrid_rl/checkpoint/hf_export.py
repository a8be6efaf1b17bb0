"""Export the (FSDP2-sharded) policy as a Hugging Face folder that `from_pretrained` and vLLM load.

The weights stream: one state-dict entry at a time is gathered in full (a collective; the largest
single weight is the most any rank holds beyond its shards) and rank 0 appends it to the safetensors
shard it is filling, writing each shard when it reaches `max_shard_bytes`. No rank ever holds the
whole model (a 7B model on 8 ranks: rank 0 holds one shard, at most 2 GiB by default, plus one
weight). Rank 0 writes into `<out>.tmp/` and renames it to `<out>/` when done, so a crash never
leaves a half-written model folder that looks loadable.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from hybrid_rl.checkpoint.collective import CAUGHT, raise_if_any_failed
from hybrid_rl.checkpoint.files import fsync_tree, replace_dir
from hybrid_rl.distributed.collectives import world_size
from hybrid_rl.distributed.fsdp import hf_name

# (name, the whole tensor on rank 0's CPU; None on the other ranks), one state-dict entry at a time.
Stream = Iterator[tuple[str, torch.Tensor | None]]
DEFAULT_SHARD_BYTES = 2 * 1024**3


def full_tensors(model: nn.Module, *, rank: int) -> Stream:
    """Collective: every state-dict entry gathered in full, in order; every rank must drain it."""
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        yield name, full.detach().cpu() if rank == 0 else None
        del full


def export_hf(model: nn.Module, tokenizer: Any, out_dir: str | Path, *, rank: int, dtype: torch.dtype | None = None,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, transform: Callable[[Stream], Stream] | None = None,
              after: Callable[[Path], None] | None = None) -> Path:
    """Collective: write `model` (+ `tokenizer`, if not None) as an HF folder at `out_dir`; returns it.

    `dtype` casts the weights (and the config's dtype), e.g. bfloat16 for serving; None keeps them as
    trained. `transform` maps the stream of gathered weights to the one written (e.g. merging a LoRA
    adapter; it runs on every rank, with None tensors off rank 0), and `after(tmp_dir)` may add files to
    the folder before it is published (rank 0 only).
    """
    out = Path(out_dir)
    hf_model = _hf_model(model)  # a ValueError here is raised by every rank alike
    stream = full_tensors(model, rank=rank)
    if transform is not None:
        stream = transform(stream)
    error = None
    writer = _ShardWriter(out.with_name(out.name + ".tmp"), tied=_tied_names(hf_model), dtype=dtype,
                          max_shard_bytes=max_shard_bytes, hf_model=hf_model) if rank == 0 else None
    for name, tensor in stream:  # every rank drains the stream: each entry is a collective
        if writer is None or error is not None:
            continue
        try:
            writer.add(name, tensor)
        except CAUGHT as e:
            error = e
    if writer is not None and error is None:
        try:
            writer.close()
            _finish_folder(hf_model, tokenizer, writer.dir, out, dtype=dtype, after=after)
        except CAUGHT as e:
            error = e
    if error is not None:
        shutil.rmtree(out.with_name(out.name + ".tmp"), ignore_errors=True)
    raise_if_any_failed(error, rank=rank, world=world_size(), what="exporting the model to", path=out)
    return out


class _ShardWriter:
    """Rank 0's side of the stream: HF names, tied copies dropped, cast, written shard by shard."""

    def __init__(self, tmp: Path, *, tied: set[str], dtype: torch.dtype | None, max_shard_bytes: int,
                 hf_model: nn.Module | None = None):
        if tmp.exists():  # left by an export that crashed
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self.dir, self.tied, self.dtype, self.max_shard_bytes = tmp, tied, dtype, max_shard_bytes
        self.hf_model = hf_model
        self.shard: dict[str, torch.Tensor] = {}
        self.shard_bytes = self.total_bytes = 0
        self.files: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        for hf, t in as_saved(self.hf_model, hf_tensors({name: tensor}, tied=self.tied, dtype=self.dtype)).items():
            nbytes = t.numel() * t.element_size()
            if self.shard and self.shard_bytes + nbytes > self.max_shard_bytes:
                self._flush()
            self.shard[hf] = t
            self.shard_bytes += nbytes
            self.total_bytes += nbytes

    def _flush(self) -> None:
        fname = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.shard, self.dir / fname, metadata={"format": "pt"})  # transformers expects the format
        self.files.append((fname, list(self.shard)))
        self.shard, self.shard_bytes = {}, 0

    def close(self) -> None:
        """The last shard; one shard is `model.safetensors`, several are indexed (as `save_pretrained` does)."""
        if self.shard or not self.files:
            self._flush()
        if len(self.files) == 1:
            (self.dir / self.files[0][0]).rename(self.dir / "model.safetensors")
            return
        weight_map = {name: fname for fname, names in self.files for name in names}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def _finish_folder(hf_model: nn.Module, tokenizer: Any, tmp: Path, out: Path, *, dtype: torch.dtype | None,
                   after: Callable[[Path], None] | None) -> None:
    """Config, generation config, tokenizer and `after`'s files beside the weights; then publish `tmp` as `out`."""
    config = copy.deepcopy(hf_model.config)  # never mutate the live model's config
    if dtype is not None:
        config.dtype = dtype
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


def as_saved(hf_model: nn.Module | None, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as `save_pretrained` writes them: transformers' own reverse of the conversions it applies when
    it loads (a mixture of experts' fused `experts.gate_up_proj` [E, 2I, H] back to one `experts.<e>.gate_proj.weight`
    and `up_proj.weight` per expert, which is what checkpoints hold and vLLM's loader reads). One fused tensor
    converts on its own, so the export still holds one gathered weight at a time."""
    if hf_model is None:
        return tensors
    from transformers.core_model_loading import revert_weight_conversion

    return {k: v.contiguous() for k, v in revert_weight_conversion(hf_model, tensors).items()}


def _tied_names(hf_model: nn.Module) -> set[str]:
    """Names that alias another weight under this config (transformers >= 5 lists only the active ties)."""
    tied = getattr(hf_model, "all_tied_weights_keys", None)
    if tied is not None:
        return set(tied)
    return {"lm_head.weight"} if getattr(hf_model.config, "tie_word_embeddings", False) else set()


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside any wrappers: the first `PreTrainedModel` (a peft wrapper forwards `config` too,
    but not the weight conversions `as_saved` reverts), else the first module carrying a `config` with
    `save_pretrained`."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return m
    for m in model.modules():
        if hasattr(getattr(m, "config", None), "save_pretrained"):
            return m
    raise ValueError(f"export_hf: {type(model).__name__} contains no Hugging Face model (no module with a "
                     "`config`); pass the transformers model (FSDP-wrapped is fine)")
