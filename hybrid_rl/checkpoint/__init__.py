"""Checkpoints: atomic, sharded DCP saves of the training state with automatic resume, and HF export.

    ckpt = Checkpointer(root, keep_last=3, rank=dims.rank, world=dims.world)
    resumed = ckpt.resume_auto({"policy": (policy, optimizer)})      # (step, rank_state, shared_state) | None
    ckpt.save(step, components={"policy": (policy, optimizer)},
              rank_state={"rng": ..., "loader": ...}, shared_state={"step": step, "scheduler": ...})
    export_hf(policy, tokenizer, out_dir, rank=dims.rank)

Every call is collective (all ranks call it with the same arguments), except `latest_complete`.
"""

from hybrid_rl.checkpoint.checkpointer import Checkpointer
from hybrid_rl.checkpoint.collective import CheckpointError
from hybrid_rl.checkpoint.hf_export import export_hf

__all__ = ["CheckpointError", "Checkpointer", "export_hf"]
