"""The training step of a mixture of experts at Qwen3-30B-A3B's layer shape: routing replay's cost, and peak memory
against the planner's.

    python benchmarks/moe_step.py [--layers 1] [--vocab 8192] [--tokens 1024] [--ranks 1] [--repeats 3]

The model is Qwen3-30B-A3B's decoder layer as its config.json gives it (128 experts, top-8, hidden 2048, expert
width (`moe_intermediate_size`) 768, 32 query heads and 4 KV heads of 128, untied head) with `--layers` of its 48
layers and the vocabulary cut from 151936 to `--vocab` (the embedding and head are then 2 x 16.8M parameters, not
2 x 311M: the step measured is the layers'); random weights, built straight into the FSDP2 shards (nothing on disk
but config.json). One layer is 623M parameters (604M of them experts); with float32 master weights, gradients and
AdamW's two moments, 16 bytes each, a layer's training state is 10 GB on its own, so one layer on one rank is what
a 24 GiB machine runs beside other jobs.

What is timed is the trainer's own update, `hybrid_rl.updates.update_actor`, under the MoE recipe's settings
(`recipes/grpo_moe.yaml`: GSPO's loss, bf16 compute copies where the CPU has bf16 instructions, activation
checkpointing) with one mini-batch (one optimizer step per update; the recipe's 4 would be 4 steps): forward,
backward (with the checkpointed recompute) and the AdamW step over one micro-batch of `--tokens` tokens, 4 samples
of a quarter each, on `--ranks` gloo ranks of FSDP2. Two sides, alternated (A B A B ...) after one warm-up update
each (AdamW creates its state in the first): `model.moe.router_replay=none` (the routers choose) and `rollout`
(every sample carries routes, `[tokens, layers, 8]` uint8 expert ids drawn at random without repeats, as vLLM's
recorded ones would arrive, and every router is overridden to them, the routing weights recomputed from its own
logits). Figures: the medians, and their ratio (replay's cost). Memory: each rank's peak RSS during the timed
updates (VmHWM, reset before each) against the planner's `update` phase for the same configuration
(`hybrid_rl.plan_inputs.plan_for`, sidecar mode so that no vLLM shares the process); before launching, the driver
refuses a shape whose plan does not fit the memory available now.

Writes benchmarks/results/moe_step.json. No target: a measurement (see results/moe_step_202611.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

GIB = 2**30
# Qwen3-30B-A3B's config.json (the layer's shape; layers and vocabulary are set per run)
A3B = {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
       "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
       "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
       "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False}
SMOKE = {**A3B, "hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128}


def model_folder(shape: dict, layers: int, vocab: int) -> Path:
    """config.json of the shape (no weights: the worker fills its shards at random), cached under .cache/models."""
    from transformers import Qwen3MoeConfig

    tag = f"qwen3moe_h{shape['hidden_size']}_e{shape['num_experts']}_k{shape['num_experts_per_tok']}_l{layers}_v{vocab}"
    path = common.CACHE / "models" / tag
    if not (path / "config.json").exists():
        Qwen3MoeConfig(**shape, num_hidden_layers=layers, vocab_size=vocab, bos_token_id=0, eos_token_id=1,
                       pad_token_id=1, architectures=["Qwen3MoeForCausalLM"]).save_pretrained(path)
    return path


def overrides(model: Path, tokens: int, ranks: int) -> list[str]:
    """The MoE recipe with one mini-batch, and a batch whose plan counts `tokens` per rank in one micro-batch."""
    per = tokens // 4  # 4 samples a rank, a quarter prompt and three quarters response
    return [f"model.path={model}", "data.train_files=[/nowhere.jsonl]", f"data.prompts_per_step={ranks}",
            "rollout.n=4", f"data.max_prompt_tokens={per // 4}", f"rollout.max_new_tokens={per - per // 4}",
            f"trainer.micro_batch_tokens={tokens}", "algorithm.mini_batches=1", "algorithm.ppo_epochs=1",
            "rollout.mode=sidecar", "model.moe.router_replay=none", f"trainer.output_dir={common.CACHE / 'moe_step'}"]


# =================================================================================================
# Worker (under torchrun)
# =================================================================================================


def worker(args: list[str], repeats: int) -> None:
    import logging

    import torch
    import torch.distributed as dist

    from hybrid_rl.algos.objectives import get_objective
    from hybrid_rl.build.settings import trainer_settings
    from hybrid_rl.config import load_config
    from hybrid_rl.distributed.fsdp import local_tensor, shard_model
    from hybrid_rl.distributed.mesh import device, fsdp_mesh, init_distributed
    from hybrid_rl.model.handle import Model
    from hybrid_rl.model.loading import DTYPES, empty_model, enable_activation_checkpointing
    from hybrid_rl.model.optimizers import build_optimizer
    from hybrid_rl.model.routing_replay import Replay, route_dtype
    from hybrid_rl.plan_inputs import plan_for
    from hybrid_rl.updates import update_actor
    from hybrid_rl.utils import memory

    logging.basicConfig(level=logging.WARNING)
    cfg = load_config("grpo_moe", args)
    dims = init_distributed(1)
    plan = plan_for(cfg, dims.world, attention="sdpa")
    s = trainer_settings(cfg, world=dims.world)
    module = empty_model(cfg.model.path, "lm")
    enable_activation_checkpointing(module)
    module.config.use_cache = False
    shard_model(module, fsdp_mesh(dims), param_dtype=DTYPES[cfg.model.dtype])
    buffers = {n: b.clone() for n, b in module.named_buffers()}  # computed for real (rotary frequencies)
    module.to_empty(device=device())
    for n, b in module.named_buffers():
        b.copy_(buffers[n])
    g = torch.Generator().manual_seed(dims.rank)
    with torch.no_grad():
        for name, p in module.named_parameters():
            t = local_tensor(p)
            t.fill_(1.0) if name.endswith("norm.weight") else t.copy_(torch.randn(t.shape, generator=g) * 0.02)
    opt = build_optimizer(cfg.optim.name, module.parameters(), lr=1e-6, betas=cfg.optim.betas)
    actor = Model(module, opt, None)
    step_s: list[float] = []  # the AdamW step's own seconds in each update (the same work on both sides)
    adamw_step = opt.step

    def timed_step(*args, **kwargs):
        t0 = time.perf_counter()
        out = adamw_step(*args, **kwargs)
        step_s.append(time.perf_counter() - t0)
        return out
    opt.step = timed_step

    hf = module.config
    per, prompt = cfg.trainer.micro_batch_tokens // 4, cfg.data.max_prompt_tokens
    experts, k, layers = hf.num_experts, hf.num_experts_per_tok, hf.num_hidden_layers
    samples, routed = [], []
    for i in range(4):
        ids = torch.randint(2, hf.vocab_size, (per,), generator=g)
        sample = _sample(i, ids[:prompt], ids[prompt:])
        samples.append(sample)
        choice = torch.rand(per - 1, layers, experts, generator=g).topk(k, dim=-1).indices
        routed.append(_with_routes(sample, choice.to(route_dtype(experts))))
    batches = {"none": _batch(samples, g), "rollout": _batch(routed, g)}
    objective = get_objective(cfg.algorithm.objective)

    def update(side: str) -> float:
        dist.barrier()
        memory.reset_peak_rss()
        t0 = time.perf_counter()
        update_actor(actor, batches[side], objective, s.loss, s.updates, Replay() if side == "rollout" else None)
        seconds = time.perf_counter() - t0
        calls.append(side)
        if len(step_s) != len(calls):
            raise RuntimeError("the update skipped its optimizer step (a non-finite gradient norm)")
        peaks[side].append(memory.peak_rss_bytes())
        optimizer[side].append(step_s[-1])
        return seconds

    peaks: dict[str, list[int]] = {"none": [], "rollout": []}
    optimizer: dict[str, list[float]] = {"none": [], "rollout": []}
    warm: dict[str, float] = {}
    calls: list[str] = []
    for side in batches:  # AdamW's state is created in the first step
        warm[side] = update(side)
    peaks, optimizer = {"none": [], "rollout": []}, {"none": [], "rollout": []}
    times = common.alternate({side: (lambda side=side: update(side)) for side in batches}, repeats)
    row = {"rank": dims.rank, "times": times, "optimizer_s": optimizer, "warmup_s": warm, "peaks": peaks,
           "plan_update": plan.phase("update").total, "plan_items": {f"{i.component} {i.what}": i.bytes
                                                                      for i in plan.phase("update").items},
           "params": sum(p.numel() for p in module.parameters()),
           "shard_bytes": sum(local_tensor(p).nbytes for p in module.parameters()), "dtype": cfg.model.dtype}
    rows = [None] * dims.world
    dist.all_gather_object(rows, row)
    if dims.rank == 0:
        common.worker_write({"world": dims.world, "ranks": rows})
    dist.destroy_process_group()


def _sample(uid: int, prompt, response):
    import torch

    from hybrid_rl.types import Sample

    return Sample(uid, prompt, response, torch.zeros(len(response)), False, uid, uid, {})


def _with_routes(sample, routes):
    from dataclasses import replace

    return replace(sample, routes=routes)


def _batch(samples: list, g):
    import torch

    from hybrid_rl.types import TrainBatch
    from hybrid_rl.updates import response_mask

    mask = response_mask(samples, max(s.response_len for s in samples))
    advantages = torch.randn(len(samples), 1, generator=g).sign().expand_as(mask) * mask
    return TrainBatch(samples, mask, torch.zeros(len(samples)), None, advantages.contiguous())


# =================================================================================================
# Driver
# =================================================================================================


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank: one micro-batch of 4 samples")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 repeats")
    p.add_argument("--smoke", action="store_true", help=common.SMOKE_HELP + " (8 experts of 32, hidden 64)")
    p.add_argument("--worker", nargs=2, metavar=("OVERRIDES_JSON", "REPEATS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(json.loads(a.worker[0]), int(a.worker[1]))
        return
    shape, tokens, repeats = (SMOKE, 64, 1) if a.smoke else (A3B, a.tokens, 2 if a.quick else a.repeats)
    model = model_folder(shape, a.layers, 512 if a.smoke else a.vocab)
    args = overrides(model, tokens, a.ranks)
    if not a.smoke:  # the smoke shape takes half a GiB
        _refuse_what_does_not_fit(args, a.ranks)
    r = common.torchrun(__file__, ["--worker", json.dumps(args), str(repeats)], nproc=a.ranks, timeout=3600,
                        tag="moe_step")
    rows = summarize(r["ranks"])
    print(common.table(rows, [("rank", "rank", "d"), ("none_s", "none s", ".2f"), ("rollout_s", "rollout s", ".2f"),
                              ("ratio", "rollout/none", ".3f"), ("pair_ratio", "per round", ".3f"),
                              ("fwd_bwd_ratio", "fwd+bwd ratio", ".3f"),
                              ("adamw_s", "AdamW s", ".2f"), ("peak_gib", "peak GiB", ".2f"),
                              ("plan_gib", "plan GiB", ".2f"), ("peak_over_plan", "peak/plan", ".3f")]))
    common.write_result("moe_step", {
        "shape": {**shape, "num_hidden_layers": a.layers, "vocab_size": a.vocab if not a.smoke else 512},
        "tokens_per_rank": tokens, "ranks": a.ranks, "repeats": repeats, "params": r["ranks"][0]["params"],
        "compute_dtype": r["ranks"][0]["dtype"], "rows": rows, "raw": r["ranks"]}, quick=a.quick)


def _refuse_what_does_not_fit(args: list[str], ranks: int) -> None:
    """The planner's update phase for every local rank against the memory available now: a shape that would not fit
    is not started (the kernel would kill it, or another job)."""
    from hybrid_rl.config import load_config
    from hybrid_rl.plan_inputs import plan_for
    from hybrid_rl.utils import memory

    need = ranks * plan_for(load_config("grpo_moe", args), ranks, attention="sdpa").phase("update").total
    free = memory.available_bytes()
    if need > free:
        raise SystemExit(f"the plan needs {need / GIB:.1f} GiB for {ranks} rank(s), {free / GIB:.1f} GiB is available "
                         "now: not run (fewer --layers or --tokens, or wait for other jobs)")
    print(f"plan: {need / GIB:.2f} GiB for {ranks} rank(s) in the update; {free / GIB:.1f} GiB available")


def summarize(ranks: list[dict]) -> list[dict]:
    out = []
    for r in ranks:
        none, rollout = common.median(r["times"]["none"]), common.median(r["times"]["rollout"])
        # forward + backward: each update less its own AdamW step
        fb = {side: common.median([t - o for t, o in zip(r["times"][side], r["optimizer_s"][side], strict=True)])
              for side in ("none", "rollout")}
        peak = max(max(v) for v in r["peaks"].values())
        pairs = [b / a for a, b in zip(r["times"]["none"], r["times"]["rollout"], strict=True)]  # A B: one round
        out.append({"rank": r["rank"], "none_s": none, "rollout_s": rollout, "ratio": rollout / none,
                    "pair_ratio": common.median(pairs), "pair_ratios": pairs,
                    "fwd_bwd_none_s": fb["none"], "fwd_bwd_rollout_s": fb["rollout"],
                    "fwd_bwd_ratio": fb["rollout"] / fb["none"],
                    "adamw_s": common.median(r["optimizer_s"]["none"] + r["optimizer_s"]["rollout"]),
                    "peak_gib": peak / GIB, "peak_none_gib": max(r["peaks"]["none"]) / GIB,
                    "peak_rollout_gib": max(r["peaks"]["rollout"]) / GIB, "plan_gib": r["plan_update"] / GIB,
                    "peak_over_plan": peak / r["plan_update"]})
    return out


if __name__ == "__main__":
    main()
