"""The tests' private etcd server (`hybrid_rl.dist.etcd_server`, shared with the demo and the benchmarks)."""

from hybrid_rl.dist.etcd_server import EtcdProcess

__all__ = ["EtcdProcess"]
