"""hybrid_rl: RL post-training of LLMs on one SPMD process group.

Every rank switches between vLLM rollout and FSDP2 training; see README.md ("Architecture").
"""

__version__ = "0.1.0"
