"""Model families: what differs between a dense transformer and a mixture of experts, behind one registry.

A family says which of the trained model's parameters are *fused* from several checkpoint tensors. transformers
trains Qwen3-MoE with each layer's experts in two 3-D tensors, `mlp.experts.gate_up_proj` [E, 2I, H] (each
expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I]; checkpoints on disk (the hub's, and
what `save_pretrained` writes) and vLLM's loader hold one 2-D tensor per expert and projection,
`mlp.experts.<e>.gate_proj.weight` [I, H] and so on. transformers converts between the two when it loads and
saves; the trainer's sharded loader (`materialize`), the weight sync (`weightsync`) and the HF export need the
same correspondence one expert at a time, which a `Fusion` gives:

    fused[e, offset : offset + rows] == checkpoint[part.format(e)]      for every expert e and part

FSDP2 shards a fused tensor along dim 0, so a rank holds whole experts, and reads and sends only theirs.
Dense families fuse nothing. Another MoE family is one more `Family` in `FAMILIES` (and its architecture in
`ARCHITECTURES`), not a branch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor per expert: `template` with `{e}` for the expert, at rows [offset, offset+rows) of
    the expert's block of the fused tensor (dim 1 of the fused [E, ...] tensor)."""

    template: str  # e.g. "experts.{e}.gate_proj.weight", relative to the MoE block (as `Fusion.suffix`)
    offset: int
    rows: int


@dataclass(frozen=True)
class Fusion:
    """A fused parameter (its name relative to the decoder layer's MoE block) and its per-expert parts."""

    suffix: str  # e.g. "experts.gate_up_proj"
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class Family:
    name: str
    moe: bool

    def fusions(self, config) -> tuple[Fusion, ...]:
        return ()

    def num_experts(self, config) -> int:
        return 0


class Qwen3Moe(Family):
    """Qwen3-MoE (and the Qwen2-MoE layout it shares): SwiGLU experts, gate rows before up rows."""

    def fusions(self, config) -> tuple[Fusion, ...]:
        i, h = config.moe_intermediate_size, config.hidden_size
        return (
            Fusion("experts.gate_up_proj", (Part("experts.{e}.gate_proj.weight", 0, i),
                                             Part("experts.{e}.up_proj.weight", i, i))),
            Fusion("experts.down_proj", (Part("experts.{e}.down_proj.weight", 0, h),)),
        )

    def num_experts(self, config) -> int:
        return int(getattr(config, "num_experts", None) or config.num_local_experts)


DENSE = Family("dense", moe=False)
FAMILIES: dict[str, Family] = {"dense": DENSE, "qwen3_moe": Qwen3Moe("qwen3_moe", moe=True)}
# Architectures (config.architectures[0]) of a family other than dense.
ARCHITECTURES: dict[str, str] = {"Qwen3MoeForCausalLM": "qwen3_moe"}


def family_of(config) -> Family:
    """The family of a transformers config (dense unless its architecture is registered as another)."""
    archs = getattr(config, "architectures", None) or [type(config).__name__.replace("Config", "ForCausalLM")]
    return FAMILIES[ARCHITECTURES.get(archs[0], "dense")]


def is_moe_folder(path: str | Path) -> bool:
    """Whether the Hugging Face model folder `path` holds a mixture of experts (its config.json's architecture is
    registered as an MoE family); False when there is no config.json to read."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return False
    archs = json.loads(file.read_text()).get("architectures") or [""]
    return FAMILIES[ARCHITECTURES.get(archs[0], "dense")].moe


@dataclass(frozen=True)
class ExpertPiece:
    """Expert `expert`'s checkpoint tensor `name` is rows [offset, offset + rows) of `fused[expert]`."""

    name: str
    expert: int
    offset: int
    rows: int


class FusedNames:
    """Which parameter names of a model are fused, and the checkpoint tensors each one holds."""

    def __init__(self, config):
        self.family = family_of(config)
        self.experts = self.family.num_experts(config)
        self._fusions = self.family.fusions(config)
        self._re = [(re.compile(rf"(.*\.)?{re.escape(f.suffix)}"), f) for f in self._fusions]

    def __bool__(self) -> bool:
        return bool(self._fusions)

    def pieces(self, name: str) -> list[ExpertPiece] | None:
        """The per-expert checkpoint tensors of fused parameter `name` (its HF name); None if it is not fused."""
        for pattern, fusion in self._re:
            m = pattern.fullmatch(name)
            if m:
                base = m.group(1) or ""  # the MoE block: parts are named relative to it, as the suffix is
                return [ExpertPiece(base + part.template.format(e=e), e, part.offset, part.rows)
                        for e in range(self.experts) for part in fusion.parts]
        return None

    def split(self, name: str, local: torch.Tensor, shape: tuple[int, ...],
              experts_held: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
        """(checkpoint name, this rank's view of it, its full shape) of every expert of fused `name`.

        `local` holds experts [a, b) (`experts_held`); an expert held elsewhere is an empty [0, ...] tensor here.
        """
        a, b = experts_held
        for pc in self.pieces(name) or []:
            full = (pc.rows, *shape[2:])
            if a <= pc.expert < b:
                yield pc.name, local[pc.expert - a, pc.offset: pc.offset + pc.rows], full
            else:
                yield pc.name, local.new_empty((0, *shape[2:])), full


def fused_owner(expert: int, experts: int, world: int) -> int:
    """The rank that holds expert `expert` under FSDP2's Shard(0) of a fused [experts, ...] tensor."""
    return expert // -(-experts // world)
