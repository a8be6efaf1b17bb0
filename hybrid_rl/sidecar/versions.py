"""Which servers hold a weight version, and which policy version sampled each token."""

from __future__ import annotations

import torch

from hybrid_rl.sidecar.etcd import Etcd
from hybrid_rl.types import Generation


def servers_at(etcd: Etcd, version: str | None) -> list[str]:
    """The URLs of the servers registered under the run's prefix that hold `version` (run id included: a server of
    another run never matches)."""
    rows = etcd.get_prefix("servers")
    return [v["url"] for _, v in sorted(rows.items()) if version is not None and v.get("version") == version]


def token_versions_of(g: Generation, policy_of: dict[str, int]) -> torch.Tensor:
    """[response tokens] int64: the policy version of each token, from the server's weight-version spans."""
    if not g.weight_spans:
        return torch.zeros(0, dtype=torch.int64)
    versions = torch.tensor([policy_of[v] for v, _, _ in g.weight_spans], dtype=torch.int64)
    return versions.repeat_interleave(torch.tensor([end - start for _, start, end in g.weight_spans]))
