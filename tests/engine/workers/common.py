"""Shared set-up for the engine's multi-process test workers (run under torchrun)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hybrid_rl.utils.env import set_runtime_defaults

set_runtime_defaults()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hybrid_rl.colocated.engine_parts import SyncTarget, TrainedPolicy  # noqa: E402
from hybrid_rl.colocated.hybrid import HybridEngine, SwitchOptions  # noqa: E402
from hybrid_rl.colocated.vllm_engine import EngineSpec, VLLMEngine  # noqa: E402
from hybrid_rl.distributed.fsdp import shard_model  # noqa: E402
from hybrid_rl.distributed.mesh import device, fsdp_mesh, init_distributed  # noqa: E402
from hybrid_rl.distributed.offload import OffloadManager  # noqa: E402
from hybrid_rl.model.loading import DTYPES, load_causal_lm  # noqa: E402
from hybrid_rl.model.logprobs import forward_logprobs  # noqa: E402
from hybrid_rl.weightsync.layout import Layout, ModelDims  # noqa: E402


def build(model_path: str, *, tp: int, dtype: str = "float32", release: str = "keep", offload: str = "none",
          bucket_mb: float = 0.25, lr: float = 1e-3, vllm: VLLMEngine | None = None, probe_cols: int = 64):
    """An FSDP policy + AdamW + HybridEngine; pass `vllm` to share one vLLM engine between policies."""
    dims = init_distributed(tp)
    torch.manual_seed(0)
    model = load_causal_lm(model_path, dtype=torch.float32)
    shard_model(model, fsdp_mesh(dims), param_dtype=DTYPES[dtype])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if vllm is None:
        # The test settings on every platform: eager (no CUDA-graph capture), a small fixed KV cache.
        vllm = VLLMEngine(EngineSpec(model_path=model_path, tp=tp, dtype=dtype, max_model_len=256, seed=0,
                                     enforce_eager=True, kv_cache_gb=0.25))
    options = SwitchOptions(bucket_bytes=int(bucket_mb * 2**20), verify=True, probe_cols=probe_cols, release=release,
                            offload_params=offload, offload_grads=offload, offload_optim=offload)
    engine = HybridEngine(
        TrainedPolicy(model, opt),
        SyncTarget(vllm, Layout(ModelDims.from_hf_config(model.config), tp), device=device(), dtype=DTYPES[dtype]),
        dims=dims, offload=OffloadManager(f"/tmp/hr_offload_{os.getpid()}", rank=dims.rank), options=options,
    )
    return engine, model, opt, dims


def train_on_samples(model, opt, prompts: list[list[int]], sampled) -> float:
    """One optimizer step on -log p of vLLM's sampled responses (`sampled[i]`: prompt i's generations); returns the
    largest |log p - vLLM's log-prob| of those tokens. Every rank in lockstep: FSDP forwards are collective."""
    max_diff, loss = 0.0, 0.0
    for i, group in enumerate(sampled):
        prompt = prompts[i]
        for gen in group:
            ids = torch.tensor([prompt + list(gen.token_ids)])
            pos = torch.arange(ids.shape[1])[None]
            lp = forward_logprobs(model, ids, pos, torch.roll(ids, -1, dims=1))[0, len(prompt) - 1 : -1]
            max_diff = max(max_diff, (lp.detach() - torch.tensor(gen.logprobs)).abs().max().item())
            loss = loss - lp.sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return max_diff


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Every weight gathered in full (collective; test-only)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}


def write_result(result: dict) -> None:
    if dist.get_rank() == 0:
        Path(os.environ["HR_TEST_OUT"]).write_text(json.dumps(result, indent=1))


def log(*a) -> None:
    print(f"[rank{dist.get_rank()}]", *a, file=sys.stderr, flush=True)
