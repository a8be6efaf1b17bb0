"""The memory planner: expected memory per rank in each phase of an RL step, before anything heavy starts.

Numbers in, a `MemoryPlan` out, pure arithmetic. Each module imports only those listed above it:

    units                         GIB and the GiB / MiB format
    param_count, activations      parameter shapes and activation bytes from a model's config.json
    inputs                        `PlanInputs`: what the planner is told (models, device, rollout, offload)
    shards, result                one rank's shard bytes; the plan as data (`Item`, `Phase`, `Fix`, `MemoryPlan`)
    trainer_memory, vllm_memory   what a trainer rank and vLLM hold in a phase; vLLM's share of a GPU
    moe                           a mixture of experts' routes (rollout replay) and notes (total / active params)
    phases                        every phase of a step
    advice                        the fixes (each a re-run of `phases`) and the notes
    estimate                      `estimate(inputs)`: the phases, notes and fixes
    table                         a plan as text (`render`, `verdict`)
    watch                         measured peaks per phase, and a warning when one exceeds its plan

Turning a run's `Config` into `PlanInputs` reads the config, which sits above this package:
`hybrid_rl/plan_inputs.py` does it, for `build.py` and the command line (`python -m hybrid_rl.plan`).

Who holds what, as `build.py`, `colocated/hybrid.py` and `trainer.py` arrange it:

* Every model is FSDP2-sharded: trained ones with float32 master weights, frozen ones (reference,
  reward model) in `model.frozen_dtype` (`ModelSpec.param_bytes`); FSDP2 pads dim 0 of
  each parameter to a multiple of the world size, so a rank holds `ceil(dim0 / W)` rows of each
  (storage), while AdamW's moments are `zeros_like` of the *unpadded* local shard (rank 0 holds the
  most). Gradients exist only between the first backward and `zero_grad(set_to_none=True)`.
* A pass all-gathers one block at a time in `model.dtype` (plus the prefetched next one); the root
  (embeddings, final norm, head) stays unsharded from forward to the end of backward, and backward
  holds one block's unsharded grads plus their float32 reduce-scatter input.
* Rollout: the optimizer state (and, after the weight sync, the actor's params) go to
  `offload.actor_optim` / `offload.actor_params`; vLLM holds its weights (rollout dtype, 1/TP, vocab
  padded to 64) and the KV cache. In train mode vLLM is released (`sleep`, `restart`) or stays
  (`keep`, the CPU default).
* Reference, critic and reward model go to `offload.<name>` after their pass and come back for it.
  The critic's optimizer state goes with it after its update and comes back only for the next one
  (and to be saved). On a CPU-only device `cpu` offload frees nothing (the bytes move to other host
  buffers).

* A mixture of experts holds every expert (memory follows the total parameters) but each token runs through
  `top_k` of them (activations follow the active ones); with rollout replay its samples carry their routes
  (`moe`), and vLLM's fused-MoE kernel has a workspace inside its share (`vllm_memory`).

* Start-up: `build.py` builds each model on the meta device and each rank reads only its own rows
  of the checkpoint into its shards, a block of at most `load_chunk_bytes` at a time; nothing else
  exists yet (AdamW's states come with the first step, vLLM with the first weight sync).

Phases (the trainer's timer names, plus `startup`, `sync` and `critic_update`): startup, sync,
rollout, old_logp, reference, critic, reward_model, teacher, update, critic_update.
"""
