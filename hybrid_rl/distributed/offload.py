"""Offload: move a component's tensors (params, grads, optimizer state) out of memory and back.

The mechanism works on *storages*, below FSDP: the bytes of each storage are copied to a backing
store, then the storage is resized to zero, which frees it while every tensor, view and DTensor
that refers to it (FSDP's sharded parameters, the optimizer's state) stays the same Python object.
Reloading resizes the storage back and copies the bytes in: bitwise exact, and nothing above this
module needs to know it happened.

Targets:
* ``cpu``: one flat host buffer per component, every storage at an aligned offset in it (`flat_layout`).
  From an accelerator the buffer is pinned by registering it with CUDA (`cudaHostRegister`): exactly its
  size, allocated and registered once and reused at every offload. Not one pinned block per tensor from
  torch's caching host allocator, which rounds each block up to a power of two (~1.9x the host memory
  of what is offloaded, measured over a 7B model's shards). On a CPU-only machine this frees nothing
  (the bytes only move to another host buffer, said once), but the code runs the same way, so the CPU
  tests exercise it; only the pinning (`_pin`) is CUDA-only.
* ``disk``: one file per component under the offload directory; frees real host memory and is
  read back with `readinto` straight into the storage.
* ``none``: stay resident.

`OffloadManager.resident` is the bracket the trainer puts around a model's pass or update: what an
earlier exit offloaded comes back, the body runs, and the model's parameters (and, when given, its
optimizer state) go out again.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

log = logging.getLogger(__name__)

TARGETS = ("none", "cpu", "disk")


HOST_ALIGN = 512  # bytes: each storage starts at a multiple of this in a flat host buffer (DMA-friendly)


@dataclass
class _Stash:
    storage: torch.UntypedStorage
    nbytes: int
    cpu: torch.Tensor | None = None  # its bytes in the component's flat host buffer ("cpu")
    offset: int = 0  # byte offset in the component's flat buffer ("cpu") or file ("disk")


def flat_layout(sizes: Iterable[int], align: int = HOST_ALIGN) -> tuple[list[int], int]:
    """Offsets of buffers of `sizes` bytes packed into one flat buffer, each aligned; and its total size."""
    offsets, end = [], 0
    for n in sizes:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + n
    return offsets, end


def power_of_two_bytes(sizes: Iterable[int]) -> int:
    """What torch's caching host allocator would hold for one pinned block per size (each rounded up to a power
    of two): the per-tensor scheme this module replaced, for comparison (tests, benchmarks)."""
    return sum(1 << max(n - 1, 0).bit_length() for n in sizes if n)


class HostBuffer:
    """One flat host buffer, pinned for asynchronous copies when `pinned` (CUDA); reused while large enough."""

    def __init__(self, nbytes: int, pinned: bool):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = pinned and nbytes > 0
        if self.pinned:
            _pin(self.tensor)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def free(self) -> None:
        if self.pinned:
            _unpin(self.tensor)
            self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)


def _pin(t: torch.Tensor) -> None:
    """Page-lock `t`'s memory in place (exactly its size: no allocator rounding). CUDA only."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size() / 2**30:.2f} GiB failed (error {err}): "
                           "too little lockable host memory? (ulimit -l, the container's memlock limit)")


def _unpin(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


@dataclass
class _Component:
    target: str
    stashes: list[_Stash] = field(default_factory=list)
    path: Path | None = None
    pinned: bool = False  # "cpu" from an accelerator: pinned buffers, asynchronous copies


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors (Adam moments, even of a one-element bias); the 0-dim `step` counters stay put.

    8-bit moments (`optim.name=adamw8bit`) are tensor subclasses without storage of their own: their codes,
    scales and code table are what is moved."""
    out = []
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out += plain_tensors(v)
    return out


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a tensor's bytes: its local shard, or the inner tensors of a tensor subclass
    (torchao's `OptimState8bit`: codes, scales, code table), found by PyTorch's `__tensor_flatten__` protocol."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for name in names for inner in plain_tensors(getattr(t, name))]


def param_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Local shards of a module's parameters (DTensors unwrapped)."""
    return [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]


def grad_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [g.to_local() if hasattr(g, "to_local") else g for p in module.parameters() if (g := p.grad) is not None]


class OffloadManager:
    """Offloads named components to cpu/disk and reloads them; reports what each holds."""

    def __init__(self, directory: str | Path, *, rank: int = 0):
        self.dir = Path(directory)
        self.rank = rank
        self._components: dict[str, _Component] = {}
        self._warned_cpu = False
        self.moved_bytes: dict[str, int] = {}  # bytes offloaded per component, summed over the run
        self._host: dict[str, HostBuffer] = {}  # pinned flat buffers, kept per component for the run

    def is_offloaded(self, name: str) -> bool:
        return name in self._components

    def offload(self, name: str, tensors: Iterable[torch.Tensor], target: str) -> int:
        """Free the storages behind `tensors` into `target`; returns the bytes freed."""
        if target not in TARGETS:
            raise ValueError(f"offload target for {name!r} must be one of {TARGETS}, got {target!r}")
        assert name not in self._components, f"{name} is already offloaded"
        tensors = list(tensors)
        if target == "none":
            return 0
        comp = _Component(target, pinned=target == "cpu" and _on_accelerator(tensors))
        if target == "cpu" and not comp.pinned and not self._warned_cpu:
            log.info("offload target 'cpu' frees nothing on a CPU-only machine: the bytes only move to other host "
                     "buffers (use 'disk' to free host RAM)")
            self._warned_cpu = True
        seen: set[int] = set()
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            comp.stashes.append(_Stash(st, st.nbytes()))
        if target == "disk":
            self._write(name, comp)
        else:
            offsets, total = flat_layout(s.nbytes for s in comp.stashes)
            flat = self._host_buffer(name, total, comp.pinned)
            for s, off in zip(comp.stashes, offsets, strict=True):
                s.offset, s.cpu = off, flat[off : off + s.nbytes]
                s.cpu.copy_(_as_bytes(s.storage), non_blocking=comp.pinned)
            _wait_for_copies(comp)
        for s in comp.stashes:
            s.storage.resize_(0)
        self._components[name] = comp
        release_freed_memory()
        freed = sum(s.nbytes for s in comp.stashes)
        self.moved_bytes[name] = self.moved_bytes.get(name, 0) + freed
        return freed

    def reload(self, name: str) -> None:
        """Bring a component back, bitwise as it was. A component that was not offloaded is left alone."""
        comp = self._components.pop(name, None)
        if comp is None:
            return
        for s in comp.stashes:
            s.storage.resize_(s.nbytes)
        if comp.target == "disk":
            self._read(comp)
        else:
            for s in comp.stashes:
                _as_bytes(s.storage).copy_(s.cpu, non_blocking=comp.pinned)
            _wait_for_copies(comp)
            for s in comp.stashes:
                s.cpu = None

    @contextmanager
    def resident(self, name: str, target: str, module: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
        """A model in memory for the body of the `with`, offloaded to `target` after it.

        Before the body, what an earlier exit offloaded comes back: the parameters (component `name`)
        and, with `optimizer`, its state (`name.optim`, which an exit without `optimizer` leaves where
        it is: a pass needs no optimizer state). After the body they go out again; the optimizer's
        state is read only then, as AdamW creates it at its first step. Gradients are not moved: the
        updates free them at every step. An error in the body leaves everything resident.
        """
        parts = [name, f"{name}.optim"] if optimizer is not None else [name]
        for part in parts:
            self.reload(part)
        yield
        self.offload(name, param_tensors(module), target)
        if optimizer is not None:
            self.offload(f"{name}.optim", optimizer_tensors(optimizer), target)

    def _host_buffer(self, name: str, nbytes: int, pinned: bool) -> torch.Tensor:
        """The component's flat host buffer: pinned ones are kept and reused (registering is slow), others are
        fresh (dropped at reload, so a CPU-only run holds them only while offloaded)."""
        if not pinned:
            return HostBuffer(nbytes, pinned=False).tensor
        buf = self._host.get(name)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                buf.free()
            buf = self._host[name] = HostBuffer(nbytes, pinned=True)
        return buf.tensor

    def host_bytes(self) -> int:
        """Host memory this manager holds for offloaded components (pinned buffers kept for the run included)."""
        kept = sum(b.nbytes for b in self._host.values())
        loose = sum(flat_layout(s.nbytes for s in c.stashes)[1] for n, c in self._components.items()
                    if c.target == "cpu" and n not in self._host)
        return kept + loose

    def close(self) -> None:
        """The run is over: delete the files of components still on disk (their tensors stay empty), unpin."""
        for comp in self._components.values():
            if comp.path is not None:
                comp.path.unlink(missing_ok=True)
        self._components.clear()
        for buf in self._host.values():
            buf.free()
        self._host.clear()

    def offloaded_bytes(self) -> dict[str, int]:
        return {n: sum(s.nbytes for s in c.stashes) for n, c in self._components.items()}

    def _write(self, name: str, comp: _Component) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        comp.path = self.dir / f"{name}.rank{self.rank}.bin"
        offset = 0
        with open(comp.path, "wb") as f:
            for s in comp.stashes:
                s.offset = offset
                if s.storage.device.type == "cpu":
                    f.write(_raw(s.storage))
                else:
                    host = _as_bytes(s.storage).cpu()
                    f.write(_raw(host.untyped_storage()))
                offset += s.nbytes

    def _read(self, comp: _Component) -> None:
        with open(comp.path, "rb") as f:
            for s in comp.stashes:
                f.seek(s.offset)
                if s.storage.device.type == "cpu":
                    f.readinto(_raw(s.storage))
                else:
                    host = torch.empty(s.nbytes, dtype=torch.uint8)
                    f.readinto(_raw(host.untyped_storage()))
                    _as_bytes(s.storage).copy_(host)
        comp.path.unlink()


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _raw(storage: torch.UntypedStorage) -> memoryview:
    """A zero-copy byte view of a host storage for file I/O.

    Not `tensor.numpy()`: exporting to numpy marks the storage non-resizable for good, and the
    offload mechanism is storage resizing.
    """
    return memoryview((ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())).cast("B")


def _on_accelerator(tensors: Iterable[torch.Tensor]) -> bool:
    return any(t.device.type != "cpu" for t in tensors)


def _wait_for_copies(comp: _Component) -> None:
    """Pinned copies run asynchronously: wait for them before a storage is freed or read."""
    if comp.pinned:
        torch.cuda.synchronize()


def release_freed_memory() -> None:
    """Hand freed host memory back to the OS (glibc keeps large freed blocks otherwise)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if os.name == "posix":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
