"""LoRA on the FSDP actor (peft): the adapter trains, the base weights stay frozen and double as the reference.

Two ways to give vLLM the policy (`model.lora.sync`):

* `adapter` (`BaseWeights` + `gather_adapter`): vLLM runs with LoRA enabled; the frozen base weights are sent
  once, and each update sends only the adapter, which vLLM loads as a LoRA adapter under a new id.
* `merged` (`LoraWeights`): vLLM gets merged weights, `W + scaling * B @ A`, computed on each rank for the rows
  it holds: FSDP shards `W` and `B` by the same output rows, and `A` (rank x in) is small enough to gather
  whole. After the first sync only the layers LoRA touches change, so only those are sent again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hybrid_rl.distributed.fsdp import local_rows, local_tensor
from hybrid_rl.model.families import ExpertPiece, FusedNames, family_of

ADAPTER = "default"


def apply_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float, target_modules: list[str]) -> nn.Module:
    """Wrap a transformers causal LM with a LoRA adapter (before FSDP sharding); only the adapter trains.

    A target that names a fused parameter of the model's family (`expert_targets`) adapts that parameter through
    peft's `target_parameters` (one low-rank pair per expert); every other name is a module, as peft takes it."""
    from peft import LoraConfig, get_peft_model

    params = expert_targets(model.config, target_modules)
    modules = [t for t in target_modules if not _names_fusion(t, params)]
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules or None,
                        target_parameters=params or None, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def expert_targets(config, target_modules: list[str]) -> list[str]:
    """The fused parameters (`model.families`, e.g. `experts.gate_up_proj`) that `target_modules` names: by their
    last part (`gate_up_proj`, `down_proj`) or all of them by `experts`."""
    return [f.suffix for f in family_of(config).fusions(config)
            if any(_names_fusion(t, [f.suffix]) for t in target_modules)]


def _names_fusion(target: str, suffixes: list[str]) -> bool:
    return any(target == s or s.endswith("." + target) or s.startswith(target + ".") for s in suffixes)


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


@contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[None]:
    """The base model alone (a LoRA run's reference), with the adapter still marked trainable.

    peft's `disable_adapter()` also sets `requires_grad=False` on the adapter. FSDP2 fixes each
    parameter group's gradient dtype at the model's first forward, from the parameters that require
    grad then: a group with none keeps no dtype, so its reduced gradients are not cast back to the
    float32 master dtype. When that first forward is the reference pass (GRPO with LoRA: the update
    gives the old log-probs, so nothing ran the actor before), every group looks frozen and the first
    backward with `model.dtype=bfloat16` assigns bf16 gradients to float32 parameters (an error).
    The pass runs without grad, so the flags change nothing in it.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    with model.disable_adapter():
        for p in trainable:
            p.requires_grad_(True)
        yield
    for p in trainable:  # peft re-enables the active adapter; anything else trainable too
        p.requires_grad_(True)


def hf_name(name: str) -> str:
    """The base model's weight name for a peft parameter name. peft nests one wrapper per adapted parameter of a
    module (`experts.base_layer.base_layer.gate_up_proj`): a base weight loses every `base_layer`; an adapter's
    tensor keeps those above its own wrapper, so that each wrapper's adapter has a name (and an initial value,
    `materialize`) of its own."""
    name = name.replace("base_model.model.", "", 1)
    if ".lora_" in name:
        return name
    while ".base_layer." in name:
        name = name.replace(".base_layer.", ".")
    return name


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """peft LoRA linear layers by their HF module name."""
    return {hf_name(n + "."): m for n, m in model.named_modules()
            if hasattr(m, "lora_A") and ADAPTER in m.lora_A and not hasattr(m, "parameter_name")}


def _wrapped(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """peft's wrappers of single parameters (`target_parameters`: a mixture's fused experts) by the HF name of the
    parameter each adapts: (the wrapper's peft module name, the wrapper)."""
    return {hf_name(f"{n}.{m.parameter_name}"): (n, m) for n, m in model.named_modules()
            if hasattr(m, "parameter_name") and hasattr(m, "lora_A") and ADAPTER in m.lora_A}


class LoraWeights:
    """What the engine syncs from a LoRA actor: merged local shards under HF names."""

    def __init__(self, model: nn.Module):
        self.model = model

    def changed_names(self) -> set[str]:
        """HF names of the weights LoRA changes (every other weight is the frozen base); an adapted fused parameter
        by its checkpoint names, one per expert and projection."""
        fused = _fused_names(self.model)
        experts = {pc.name for hf in _wrapped(self.model) for pc in fused.pieces(hf) or []}
        return {f"{prefix}weight" for prefix in _lora_layers(self.model)} | experts

    def weights(self) -> Iterator[tuple[str, torch.Tensor | Callable[[], torch.Tensor], tuple[int, ...]]]:
        """(HF name, this rank's dim-0 shard, full shape) for every base weight; a LoRA layer's as a function
        that merges it when called (a collective: it gathers `A`), so that only the weights being sent exist."""
        layers, wrapped = _lora_layers(self.model), _wrapped(self.model)
        for name, p in self.model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                continue
            hf = hf_name(name)
            prefix = hf[: -len("weight")] if hf.endswith(".weight") else None
            layer = layers.get(prefix)
            if hf in wrapped:
                yield from _merged_experts(self.model, hf, p, wrapped[hf][1])
            elif layer is None:
                yield from _frozen(self.model, hf, p)
            else:
                yield hf, functools.partial(_merged_shard, p, layer), tuple(p.shape)


class BaseWeights:
    """What the engine syncs from a LoRA actor whose adapter goes to vLLM by itself: the frozen base weights
    (HF names, this rank's dim-0 shard), sent once; nothing of them changes afterwards."""

    def __init__(self, model: nn.Module):
        self.model = model

    def changed_names(self) -> set[str]:
        return set()

    def weights(self) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
        for name, p in self.model.named_parameters():
            if ".lora_A." not in name and ".lora_B." not in name:
                yield hf_name(name), local_tensor(p).detach(), tuple(p.shape)


def _frozen(model: nn.Module, hf: str, p: nn.Parameter) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """A base weight LoRA leaves alone, by its checkpoint names: a mixture's fused experts (`model.families`) as one
    weight per expert and projection, as `weightsync.source.ModuleWeights` offers them."""
    fused = _fused_names(model)
    if fused and fused.pieces(hf) is not None:
        yield from fused.split(hf, local_tensor(p).detach(), tuple(p.shape), local_rows(p))
    else:
        yield hf, local_tensor(p).detach(), tuple(p.shape)


def _merged_experts(model: nn.Module, hf: str, p: nn.Parameter,
                    wrapper: nn.Module) -> Iterator[tuple[str, Callable[[], torch.Tensor], tuple[int, ...]]]:
    """An adapted fused parameter by its checkpoint names (one per expert and projection, as `_frozen`), each a
    function giving its part of this rank's merged experts. The first call merges them all, `W + scaling * delta`
    for the experts the rank holds (a collective: it gathers the adapter); the last one drops them. Every rank
    calls every piece in the same order (`plan.SourceParam`), those of experts it does not hold too."""
    a, b = local_rows(p)
    pieces = _fused_names(model).pieces(hf)
    merged: list[torch.Tensor] = []
    left = [len(pieces)]

    def piece(pc: ExpertPiece) -> torch.Tensor:
        if not merged:
            merged.append(_merged_expert_shard(p, wrapper, (a, b)))
        out = merged[0][pc.expert - a, pc.offset: pc.offset + pc.rows] if a <= pc.expert < b else \
            merged[0].new_empty((0, *p.shape[2:]))
        left[0] -= 1
        if not left[0]:  # the fused parameter's last piece: the next sync merges again
            merged.clear()
            left[0] = len(pieces)
        return out

    for pc in pieces:
        yield pc.name, functools.partial(piece, pc), (pc.rows, *p.shape[2:])


@torch.no_grad()
def _merged_expert_shard(p: nn.Parameter, wrapper: nn.Module, held: tuple[int, int]) -> torch.Tensor:
    """`W + scaling * delta` for the experts [a, b) this rank holds of a fused [E, ...] parameter."""
    a, b = held
    full = [t.full_tensor() if hasattr(t, "full_tensor") else t
            for t in (wrapper.lora_A[ADAPTER].weight, wrapper.lora_B[ADAPTER].weight)]
    # peft's own flag for the layout of the fused tensor ([E, out, in] as transformers' experts, or [E, in, out])
    delta = expert_delta(*full, wrapper.num_experts, wrapper._did_swap_in_out_features, experts=(a, b))
    merged = local_tensor(p).float() + wrapper.scaling[ADAPTER] * delta
    return merged.to(p.dtype)


def expert_delta(a: torch.Tensor, b: torch.Tensor, num_experts: int, swapped: bool,
                 experts: tuple[int, int] | None = None) -> torch.Tensor:
    """peft's `ParamWrapper.get_delta_weight` (unscaled, float32) from whole adapter tensors, for experts [lo, hi):
    `A` [r*E, in] holds expert e's rows at [e*r, (e+1)*r), `B` [out, r*E] its columns at e, e+E, e+2E, ..."""
    lo, hi = experts or (0, num_experts)
    a = a.float().reshape(num_experts, -1, a.shape[-1])[lo:hi]  # [e, r, in]
    b = b.float().reshape(b.shape[0], -1, num_experts)[..., lo:hi]  # [out, r, e]
    return torch.einsum("o r e, e r i -> e o i" if swapped else "o r e, e r i -> e i o", b, a)


def _fused_names(model: nn.Module) -> FusedNames | None:
    config = getattr(model, "config", None)
    return FusedNames(config) if config is not None else None


@torch.no_grad()
def gather_adapter(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's whole tensors under their peft names, on every rank (a collective: each is all-gathered)."""
    out = {}
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
    return out


@torch.no_grad()
def _merged_shard(p: nn.Parameter, layer: nn.Module) -> torch.Tensor:
    """`W + scaling * B @ A` for the rows of `W` this rank holds (B is sharded like W; A is gathered whole)."""
    a = layer.lora_A[ADAPTER].weight
    a = a.full_tensor() if hasattr(a, "full_tensor") else a
    b = local_tensor(layer.lora_B[ADAPTER].weight)
    merged = local_tensor(p).float() + layer.scaling[ADAPTER] * (b.float() @ a.float())
    return merged.to(p.dtype)


def merge_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A gathered peft state dict -> the merged base model's state dict (HF names)."""
    return dict(merged_stream(model, iter(full.items()), {}))


def merged_stream(model: nn.Module, stream: Iterator[tuple[str, torch.Tensor | None]],
                  adapter: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """A stream of gathered peft weights (in state-dict order) -> the merged base model's (HF names).

    A LoRA layer's base weight waits for its `lora_A` and `lora_B`, which follow it, then comes out as
    `W + scaling * B @ A`. The adapter's own tensors are also kept in `adapter` (for `save_adapter`).
    Tensors may be None (ranks other than the writer): names still flow, so every rank iterates alike.
    """
    scaling = {prefix: layer.scaling[ADAPTER] for prefix, layer in _lora_layers(model).items()}
    wrappers = {module: (hf, w) for hf, (module, w) in _wrapped(model).items()}
    wrapped = {hf: module for module, (hf, _) in wrappers.items()}
    pending: dict[str, dict[str, torch.Tensor | None]] = {}
    for name, t in stream:
        module, part = _lora_part(name)
        if part is None:
            hf = hf_name(name)
            prefix = hf[: -len("weight")] if hf.endswith(".weight") else None
            if hf in wrapped:
                module, part = wrapped[hf], "w"
            elif prefix not in scaling:
                yield hf, t
                continue
            else:
                module, part = name[: -len(".base_layer.weight")], "w"
        elif t is not None:
            adapter[name] = t
        slot = pending.setdefault(module, {})
        slot[part] = t
        if len(slot) == 3:
            del pending[module]
            w, a, b = slot["w"], slot["a"], slot["b"]
            if module in wrappers:
                hf, wrapper = wrappers[module]
                delta = None if w is None else wrapper.scaling[ADAPTER] * expert_delta(
                    a, b, wrapper.num_experts, wrapper._did_swap_in_out_features)
            else:
                hf = hf_name(module + ".base_layer.weight")
                delta = None if w is None else scaling[hf[: -len("weight")]] * (b.float() @ a.float())
            yield hf, None if w is None else (w.float() + delta).to(w.dtype)
    assert not pending, f"LoRA layers without all their parts: {sorted(pending)[:3]}"


def _lora_part(name: str) -> tuple[str, str | None]:
    """(module, "a" | "b") for an adapter tensor's name, else (name, None)."""
    for marker, part in ((f".lora_A.{ADAPTER}.weight", "a"), (f".lora_B.{ADAPTER}.weight", "b")):
        if name.endswith(marker):
            return name[: -len(marker)], part
    return name, None


def save_adapter(model: nn.Module, full: dict[str, torch.Tensor], out_dir) -> None:
    """The adapter alone, as peft writes it (adapter_config.json + adapter_model.safetensors)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    model.peft_config[ADAPTER].save_pretrained(str(out_dir))
    adapter = get_peft_model_state_dict(model, state_dict=full, adapter_name=ADAPTER)
    save_file({k: v.contiguous() for k, v in adapter.items()}, f"{out_dir}/adapter_model.safetensors",
              metadata={"format": "pt"})
