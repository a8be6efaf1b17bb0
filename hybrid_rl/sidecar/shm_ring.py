"""The checkpoint engine's data plane: a ring of shared-memory slots between a weight writer and a vLLM worker.

One ring per vLLM TP rank of a pod. The writer (a trainer rank, or a pod's receiver) places one bucket
of that TP rank's weight slices in a slot; the reader (the weight-transfer backend inside the vLLM
server's worker, `shm_transfer.py`) loads it and hands the slot back. `slots` buckets at most are in
flight, so the memory of an update is bounded by `slots x bucket` whatever the model size, and the
writer fills bucket k+1 while the server loads bucket k.

Files (all under `/dev/shm`, named `<namespace>-tp<r>-...`):

* `ctl`: int64 [slots, 2], per slot the sequence number last written and last consumed. Every bucket of
  the ring's life gets the next sequence number (1, 2, ...), so a stale slot is never mistaken for a
  new one. The writer writes the data, then the `written` counter; the reader checks the counter, then
  reads. Aligned 8-byte stores are atomic, each counter has one writer, and x86 (TSO) does not reorder
  stores with earlier stores; a weakly ordered CPU (arm64) would need a fence here, which is not written.
* `slot<s>`: the bytes of one bucket, each tensor at a 64-byte aligned offset (`Entry`).
* `report`: written by the reader after each update: the checksums of what landed (verification).

On CUDA the slots are host memory that both sides pin (`cudaHostRegister`) so that the writer's
device-to-host and the server's host-to-device copies are DMA; the protocol is the same and is what
the CPU tests run.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hybrid_rl.sidecar.auth import SecretError, check_private
from hybrid_rl.sidecar.leftovers import identity, sweep_rings
from hybrid_rl.utils.shm import SHM_DIR, shm_free_bytes
from hybrid_rl.weightsync.layout import TPSlice
from hybrid_rl.weightsync.verify import verify_targets

ALIGN = 64
_WRITTEN, _CONSUMED = 0, 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RingTimeout(TimeoutError):
    """The other side of the ring did not answer in time (its process died or hangs)."""


class RingSquatted(RuntimeError):
    """A ring file exists that this writer did not create, or that is not private to this user."""


class RingAborted(RuntimeError):
    """The update was abandoned while this side waited (the server failed)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a bucket: the slice it is, and where its bytes sit in the slot."""

    slice: TPSlice
    offset: int  # bytes from the slot's start
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.slice.numel * torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    def to_json(self) -> dict:
        return {"slice": asdict(self.slice), "offset": self.offset, "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict) -> Entry:
        s = dict(d["slice"])
        s["full_shape"] = tuple(s["full_shape"])
        return cls(TPSlice(**s), int(d["offset"]), d["dtype"])


def layout_bucket(slices: list[TPSlice], dtype: torch.dtype) -> tuple[list[Entry], int]:
    """Entries of one bucket packed at aligned offsets, and the bytes the slot needs."""
    name = next(k for k, v in DTYPES.items() if v == dtype)
    elt = torch.empty((), dtype=dtype).element_size()
    entries, off = [], 0
    for ts in slices:
        entries.append(Entry(ts, off, name))
        off += -(-ts.numel * elt // ALIGN) * ALIGN
    return entries, off


@dataclass(frozen=True)
class Manifest:
    """What one update sends to one TP rank: the entries of each bucket, and what to verify."""

    update: int  # the update's number (the verification report carries it back; the probe columns rotate with it)
    probe_cols: int
    buckets: list[list[Entry]]
    tied: bool = False  # tied word embeddings: the head is verified too, as the logits read it (`verify_targets`)

    def to_json(self) -> str:
        return json.dumps({"update": self.update, "probe_cols": self.probe_cols, "tied": self.tied,
                           "buckets": [[e.to_json() for e in b] for b in self.buckets]})

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        return cls(d["update"], d["probe_cols"], [[Entry.from_json(e) for e in b] for b in d["buckets"]],
                   bool(d.get("tied", False)))

    def targets(self) -> list[tuple[int, TPSlice]]:
        """What the server's verification report covers, in its order."""
        return verify_targets([e.slice for b in self.buckets for e in b], tied=self.tied)


def bucket_bytes(entries: list[Entry]) -> int:
    """The bytes of a slot that one bucket's entries (of a manifest) fill."""
    return max((e.offset + e.nbytes for e in entries), default=0)


def write_manifest(ring: ShmRing, manifest: Manifest) -> None:
    """Writer: the shard manifest of the next update, beside the ring (atomic rename)."""
    write_private(ring.paths["manifest"], manifest.to_json().encode())


def read_manifest(ring: ShmRing) -> Manifest:
    return Manifest.from_json(read_private(ring.paths["manifest"]).decode())


def write_private(path: Path, data: bytes) -> None:
    """`data` into `path` through a file of this user only (mode 0600, created exclusively, no symlink followed),
    renamed into place: nobody else can have prepared either name."""
    tmp = path.with_name(path.name + ".tmp")
    with suppress(FileNotFoundError):  # our own, left by an update that failed midway; another user's is refused
        check_private(tmp)
        tmp.unlink()
    fd = _create(tmp)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_private(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        check_private(path, os.fstat(fd))
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def _create(path: Path) -> int:
    """A new file of this user only, or RingSquatted when the name is taken (by anyone: names are per launch)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        try:
            owner = os.lstat(path).st_uid
        except OSError:
            owner = "?"
        raise RingSquatted(f"{path} exists already (owner uid {owner}): shared-memory ring names are new for each "
                           "launch, so another process made it; refused") from None


def abort_path(namespace: str, shm_dir: Path = SHM_DIR) -> Path:
    """Present while an update of `namespace` is being abandoned: every writer stops waiting for the server."""
    return shm_dir / f"{namespace}-abort"


def ring_paths(namespace: str, tp_rank: int, slots: int, shm_dir: Path = SHM_DIR) -> dict[str, Path]:
    base = f"{namespace}-tp{tp_rank}"
    paths = {"ctl": shm_dir / f"{base}-ctl", "report": shm_dir / f"{base}-report",
             "manifest": shm_dir / f"{base}-manifest.json", "owner": shm_dir / f"{base}-owner"}
    paths.update({f"slot{s}": shm_dir / f"{base}-slot{s}" for s in range(slots)})
    return paths


def _map(path: Path, nbytes: int, *, create: bool, made: list[Path]) -> torch.Tensor:
    """A uint8 tensor over the file's pages, shared with every process that maps it. The writer creates the file
    (exclusively, 0600); the reader maps only a regular file of its own user that nobody else may open, checked on
    the open file itself and mapped through that descriptor (the name cannot be swapped in between)."""
    if create:
        fd = _create(path)
        made.append(path)
        try:
            os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
    else:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        try:
            check_private(path, st)
        except SecretError as e:
            raise RingSquatted(f"shared-memory ring file refused: {e}") from None
        if st.st_size < nbytes:
            raise ValueError(f"{path} holds {st.st_size} bytes, fewer than the {nbytes} expected")
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        os.close(fd)


class ShmRing:
    """One side of the ring of TP rank `tp_rank` in `namespace`. The writer creates the files (and removes
    them in `close`); the reader maps the existing ones."""

    def __init__(self, namespace: str, tp_rank: int, *, slots: int, slot_bytes: int, create: bool,
                 shm_dir: Path = SHM_DIR, pin: bool = False):
        self.namespace, self.tp_rank, self.slots, self.slot_bytes = namespace, tp_rank, slots, slot_bytes
        self.paths = ring_paths(namespace, tp_rank, slots, shm_dir)
        self.owner = create
        if create:  # tmpfs allocates on write: a ring that does not fit would kill the writer with SIGBUS later
            _sweep_once(Path(shm_dir))
            have = sum(p.stat().st_size for p in self.paths.values() if p.exists())
            check_space(slots * (slot_bytes + 16) - have, Path(shm_dir), f"the shared-memory ring {namespace}-tp{tp_rank}")
        made: list[Path] = []  # the files this writer created, removed again if a later one is refused
        try:
            if create:  # who wrote it: a later start removes it once this process is gone (`leftovers.py`)
                write_private(self.paths["owner"], identity().encode())
                made.append(self.paths["owner"])
            self.ctl = _map(self.paths["ctl"], slots * 2 * 8, create=create, made=made).view(torch.int64).view(slots, 2)
            self.buffers = [_map(self.paths[f"slot{s}"], slot_bytes, create=create, made=made) for s in range(slots)]
        except BaseException:
            for p in made:
                p.unlink(missing_ok=True)
            raise
        if create:
            self.ctl.zero_()
        self.pinned: list[torch.Tensor] = []
        if pin:  # CUDA: page-locked, so copies to and from the GPU are DMA
            self._pin()

    def _pin(self) -> None:
        cudart = torch.cuda.cudart()
        for b in self.buffers:
            rc = cudart.cudaHostRegister(b.data_ptr(), b.numel(), 0)
            if int(getattr(rc, "value", rc)) != 0:  # cudaSuccess; any other code leaves the pages pageable
                self._unpin()
                raise RuntimeError(f"cudaHostRegister of {b.numel()} bytes of {self.paths['ctl'].name[:-4]} failed "
                                   f"with CUDA error {rc}: the locked-memory limit (ulimit -l) or the host memory is "
                                   "too small for sidecar.slots x rollout.bucket_mb")
            self.pinned.append(b)

    def _unpin(self) -> None:
        cudart = torch.cuda.cudart()
        for b in self.pinned:
            cudart.cudaHostUnregister(b.data_ptr())
        self.pinned = []

    @classmethod
    def open_reader(cls, namespace: str, tp_rank: int, *, shm_dir: Path = SHM_DIR, pin: bool = False) -> ShmRing:
        """Map a ring the writer made: its slot count and size are read from the files."""
        ctl = ring_paths(namespace, tp_rank, 0, shm_dir)["ctl"]
        slots = os.lstat(ctl).st_size // 16
        slot_bytes = os.lstat(ring_paths(namespace, tp_rank, 1, shm_dir)["slot0"]).st_size
        return cls(namespace, tp_rank, slots=slots, slot_bytes=slot_bytes, create=False, shm_dir=shm_dir, pin=pin)

    # -- the protocol ----------------------------------------------------------------------------

    def slot_of(self, seq: int) -> int:
        return (seq - 1) % self.slots

    def acquire(self, seq: int, *, timeout_s: float, aborted=None) -> int:
        """Writer: wait until the slot of bucket `seq` holds nothing unconsumed; returns the slot.
        RingAborted as soon as `aborted()` is true."""
        s = self.slot_of(seq)
        _wait(lambda: int(self.ctl[s, _CONSUMED]) == int(self.ctl[s, _WRITTEN]), timeout_s,
              f"the vLLM server did not load bucket {int(self.ctl[s, _WRITTEN])} of {self.paths['ctl'].name}",
              aborted)
        return s

    def reset(self) -> None:
        """Writer, before an update: whatever an abandoned update left unconsumed is dropped."""
        self.ctl[:, _CONSUMED] = self.ctl[:, _WRITTEN]

    def views(self, slot: int, entries: list[Entry]) -> list[torch.Tensor]:
        """The slot's bytes as one tensor per entry (write into them, or read them)."""
        buf = self.buffers[slot]
        out = []
        for e in entries:
            if e.offset + e.nbytes > self.slot_bytes:
                raise ValueError(f"bucket entry {e.slice.hf_name} ends at byte {e.offset + e.nbytes}, past the "
                                 f"{self.slot_bytes}-byte slot")
            out.append(buf[e.offset: e.offset + e.nbytes].view(DTYPES[e.dtype]).view(e.slice.shape))
        return out

    def publish(self, seq: int) -> None:
        """Writer: bucket `seq` is in its slot."""
        self.ctl[self.slot_of(seq), _WRITTEN] = seq

    def wait_written(self, seq: int, *, timeout_s: float) -> int:
        """Reader: wait until bucket `seq` is in its slot; returns the slot."""
        s = self.slot_of(seq)
        _wait(lambda: int(self.ctl[s, _WRITTEN]) >= seq, timeout_s,
              f"the trainer did not write bucket {seq} into {self.paths['ctl'].name}")
        if int(self.ctl[s, _WRITTEN]) != seq:
            raise RuntimeError(f"{self.paths['ctl'].name}: slot {s} holds bucket {int(self.ctl[s, _WRITTEN])}, "
                               f"expected {seq} (the writer overran an unconsumed slot)")
        return s

    def release(self, seq: int) -> None:
        """Reader: bucket `seq` is loaded; its slot may be reused."""
        self.ctl[self.slot_of(seq), _CONSUMED] = seq

    def drain(self, *, timeout_s: float) -> None:
        """Writer: wait until every published bucket has been consumed."""
        for s in range(self.slots):
            _wait(lambda s=s: int(self.ctl[s, _CONSUMED]) == int(self.ctl[s, _WRITTEN]), timeout_s,
                  f"the vLLM server did not load every bucket of {self.paths['ctl'].name}")

    def last_seq(self) -> int:
        return int(self.ctl[:, _WRITTEN].max())

    # -- the verification report -----------------------------------------------------------------

    def write_report(self, update: int, digests: torch.Tensor) -> None:
        """Reader: the checksums of what landed in update `update` (atomic: written aside, then renamed)."""
        payload = torch.cat([torch.tensor([float(update)], dtype=torch.float64), digests.double().cpu()])
        write_private(self.paths["report"], payload.numpy().tobytes())

    def read_report(self, update: int) -> torch.Tensor:
        """Writer: the reader's checksums of update `update` (RuntimeError when it wrote none for it)."""
        path = self.paths["report"]
        raw = read_private(path) if path.exists() else b""
        values = torch.frombuffer(bytearray(raw), dtype=torch.float64) if raw else torch.zeros(0, dtype=torch.float64)
        if values.numel() == 0 or int(values[0]) != update:
            raise RuntimeError(f"{path}: the vLLM server wrote no verification report for weight update {update}")
        return values[1:]

    def close(self) -> None:
        if self.pinned:
            self._unpin()
        self.buffers = []
        if self.owner:
            for p in self.paths.values():
                p.unlink(missing_ok=True)
            for key in ("report", "manifest"):
                self.paths[key].with_name(self.paths[key].name + ".tmp").unlink(missing_ok=True)


_swept: set[Path] = set()


def _sweep_once(shm_dir: Path) -> None:
    """A writer's first ring in `shm_dir`: rings of killed runs go first (their writers dead, nobody mapping them)."""
    if shm_dir not in _swept:
        _swept.add(shm_dir)
        sweep_rings(shm_dir)


class ShmSpaceError(RuntimeError):
    """/dev/shm has less room than the rings need."""


def check_space(nbytes: int, shm_dir: Path = SHM_DIR, what: str = "the checkpoint engine's rings") -> None:
    """ShmSpaceError naming the size needed and the settings to change, when `shm_dir` has less than `nbytes` free."""
    free = shm_free_bytes(shm_dir)
    if nbytes > free:
        raise ShmSpaceError(
            f"{what} needs {nbytes / 2**20:.0f} MiB of shared memory in {shm_dir}, which has {free / 2**20:.0f} MiB "
            "free (containers often get 64 MiB): give it more (docker run --shm-size=..., a Kubernetes emptyDir with "
            "medium: Memory on /dev/shm) or need less: the rings hold sidecar.slots buckets of rollout.bucket_mb per "
            "server TP rank, so lower rollout.bucket_mb or sidecar.slots")


def _wait(ready, timeout_s: float, what: str, aborted=None) -> None:
    """Poll `ready()` with a backoff from 50 us to 5 ms: the other side is another process, and a bucket takes
    milliseconds to fill or load."""
    deadline = time.monotonic() + timeout_s
    pause = 5e-5
    while not ready():
        if aborted is not None and aborted():
            raise RingAborted(f"update abandoned while waiting: {what}")
        if time.monotonic() > deadline:
            raise RingTimeout(f"{what} within {timeout_s:.0f} s")
        time.sleep(pause)
        pause = min(pause * 2, 5e-3)
