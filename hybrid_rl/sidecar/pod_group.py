"""Process groups between the training pod's checkpoint-engine writers and the other pods' receivers.

They live outside the trainer's torchrun world (the other pods are not trainer ranks), on their own
TCPStore, one group per vLLM TP rank: group r = {trainer writer r (group rank 0), the receiver of every
other pod}. Each bucket of TP rank r is one broadcast in group r, so P pods receive an update in about
the time of one. Control messages (headers, manifests, agreement) always go over gloo; the weights go
over a second group per TP rank whose backend is the platform's: gloo on CPU, NCCL on GPUs, where each
bucket is staged through the GPU (the rings are host memory) — `payload_device` says where the staging
buffer lives, so the CPU test runs the staged path too (RDMA/NIXL, without the staging, is the follow-up).

Members: writers are members 0..tp-1, the receiver of pod p (p >= 1) is member tp + p - 1. Member 0
hosts the store; its address travels through etcd.
"""

from __future__ import annotations

import datetime
import json
import socket
import time

import torch
import torch.distributed as dist

MAX_JSON_BYTES = 256 * 2**20  # a control message (header, shard manifest) larger than this is refused unread


def pod_store(host: str, port: int, *, member: int, tp: int, pods: int, timeout_s: float) -> dist.TCPStore:
    """The groups' rendezvous: member 0 hosts it (`port` 0: a free one, then `store.port`), the others connect.
    The host listens on `host` only (TCPStore alone would listen on every interface): a socket bound here is
    handed to it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if member != 0:
        return dist.TCPStore(host, port, tp + pods - 1, False, timeout, wait_for_workers=False)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(max(64, 2 * (tp + pods)))
        store = dist.TCPStore(host, sock.getsockname()[1], tp + pods - 1, True, timeout, wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


def payload_device_for(*, cuda: bool, local_rank: int) -> torch.device | None:
    """Where weight buckets are staged for the broadcast: this process's GPU (NCCL), else nowhere (gloo reads host
    memory directly)."""
    return torch.device("cuda", local_rank) if cuda else None


def wait_for_members(store: dist.Store, *, member: int, tp: int, pods: int, timeout_s: float) -> None:
    """Mark `member` present in the store, then wait until every member is (at most `timeout_s`). Gloo's own
    rendezvous can wait past its timeout for a peer that never came (a pod that died while starting), so the groups are
    built only once everyone is known to be there; otherwise TimeoutError names who is missing."""
    store.set(f"joined/{member}", b"1")
    keys = [f"joined/{m}" for m in range(tp + pods - 1)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [m for m, key in enumerate(keys) if not store.check([key])]
            writers = [m for m in missing if m < tp]
            receivers = [m - tp + 1 for m in missing if m >= tp]
            what = [f"pod {', '.join(map(str, receivers))} (python -m hybrid_rl.pod ... sidecar.pod=<p>)"] if receivers \
                else []
            what += [f"the trainer's writer for TP rank {', '.join(map(str, writers))}"] if writers else []
            raise TimeoutError(f"the pod group is incomplete after {timeout_s:.0f} s (sidecar.pod_wait_s): "
                               f"{' and '.join(what)} did not join; see that pod's log")
        time.sleep(0.2)


class PodGroup:
    """Blocks until every member has joined (at most `join_timeout_s`, default `timeout_s`), then builds the groups.

    `payload_device` None: weights are broadcast from host memory over gloo. A device: over NCCL when it is a
    GPU (gloo for a CPU device: the staged path as the CPU test runs it), through a staging buffer there.
    """

    def __init__(self, store: dist.TCPStore, *, member: int, tp: int, pods: int, timeout_s: float,
                 payload_device: torch.device | None = None, join_timeout_s: float | None = None):
        self.member, self.tp, self.pods, self.store = member, tp, pods, store
        self.payload_device = payload_device
        wait_for_members(store, member=member, tp=tp, pods=pods,
                         timeout_s=timeout_s if join_timeout_s is None else join_timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.groups: dict[int, dist.ProcessGroup] = {}
        self.payload: dict[int, dist.ProcessGroup] = {}
        for r in range(tp):
            if member == r or member >= tp:
                rank = 0 if member == r else member - tp + 1
                self.groups[r] = dist.ProcessGroupGloo(dist.PrefixStore(f"tp{r}", store), rank, pods, timeout)
                self.payload[r] = self._payload_group(dist.PrefixStore(f"tp{r}-weights", store), rank, timeout)

    def _payload_group(self, store: dist.Store, rank: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
        if self.payload_device is not None and self.payload_device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, self.pods, opts)
        return dist.ProcessGroupGloo(store, rank, self.pods, timeout)

    def broadcast(self, tp_rank: int, tensor: torch.Tensor) -> None:
        """Writer `tp_rank` sends `tensor`, every receiver fills its own (same size and dtype). Control: gloo."""
        _broadcast(self.groups[tp_rank], tensor)

    def broadcast_weights(self, tp_rank: int, tensor: torch.Tensor) -> None:
        """`broadcast` for a bucket of weights (host memory): over the payload group, staged when it has a device."""
        if self.payload_device is None:
            _broadcast(self.payload[tp_rank], tensor)
            return
        staged = tensor.to(self.payload_device, non_blocking=True) if self.member == tp_rank else \
            torch.empty(tensor.shape, dtype=tensor.dtype, device=self.payload_device)
        _broadcast(self.payload[tp_rank], staged)
        if self.member != tp_rank:
            tensor.copy_(staged)

    def broadcast_json(self, tp_rank: int, value=None):
        """A JSON value from writer `tp_rank` to every receiver (the writer passes it, receivers get it)."""
        data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8) if value is not None \
            else torch.zeros(0, dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        self.broadcast(tp_rank, size)
        if value is None:
            data = torch.empty(bounded(int(size[0]), MAX_JSON_BYTES, "a control message"), dtype=torch.uint8)
        self.broadcast(tp_rank, data)
        return json.loads(bytes(data.numpy()).decode())

    def all_min(self, value: float) -> float:
        """The minimum of `value` over group 0 (writer 0 and every receiver)."""
        t = torch.tensor([value], dtype=torch.float64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.groups[0].allreduce([t], opts).wait()
        return float(t[0])

    def all_values(self, value: float) -> list[float]:
        """Every member's `value` of group 0, by group rank (writer 0 first)."""
        t = torch.zeros(self.pods, dtype=torch.float64)
        t[0 if self.member == 0 else self.member - self.tp + 1] = value
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.groups[0].allreduce([t], opts).wait()
        return t.tolist()


def bounded(n: int, limit: int, what: str) -> int:
    """`n`, a size another process sent, before anything is allocated for it: ValueError unless 0 <= n <= limit."""
    if not 0 <= n <= limit:
        raise ValueError(f"{what} of {n} bytes announced by the pod group's writer: refused (limit {limit} bytes)")
    return n


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()
