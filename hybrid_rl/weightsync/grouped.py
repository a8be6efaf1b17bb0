"""A bucket of a weight sync as a few grouped operations, not a few per weight.

On one GPU a sync of a 0.5B model's 0.99 GB took 240x a device copy of its bytes: 290 weights, each with its own
casts, copies and checksum kernels (each a launch, plus Python). Here a bucket's copies are one
`torch._foreach_copy_` per pair of dtypes, and its checksums one pass over one buffer of the probed values
(`bucket_checksums`): what a sync dispatches for a bucket does not grow with the number of its weights
(tests/unit/weightsync/test_grouped_ops.py counts it).
"""

from __future__ import annotations

import numpy as np
import torch

from hybrid_rl.weightsync.verify import band_start, block_checksum, probe_band


def fill_send(send: torch.Tensor, sends: list[list], local: dict[int, torch.Tensor], partial: torch.Tensor,
               probe_cols: int, sync_index: int) -> None:
    """Cast every piece this rank sends into `send`, and add its checksum to `partial[destination, weight]`.

    A block sent to several ranks (every TP rank needs a replicated weight; at tp=1 every rank needs all of them) is
    cast and checksummed once; its other copies are plain copies in the rollout dtype. Copies are grouped
    (`torch._foreach_copy_`) and the checksums taken in one pass (`bucket_checksums`): the operations dispatched do
    not grow with the number of weights in the bucket."""
    firsts: dict[tuple, int] = {}  # block -> its number among the first copies
    first_views, sources, probed, row0s, cols = [], [], [], [], []
    dup_views, dup_of, dest, index, which = [], [], [], [], []
    off = 0
    for d, pieces in enumerate(sends):
        for pc in pieces:
            view = send[off : off + pc.numel].view(pc.shape)
            off += pc.numel
            key = (pc.index, pc.rows, pc.cols, pc.slice_row0)
            if key in firsts:
                dup_views.append(view)
                dup_of.append(first_views[firsts[key]])
            else:
                firsts[key] = len(first_views)
                first_views.append(view)
                sources.append(source_block(local[pc.index], pc))
                c = None if pc.slice_ncols is None else probe_band(pc.slice_ncols, probe_cols, sync_index)
                probed.append(view if c is None else view.narrow(1, c.start, len(c)))
                row0s.append(pc.slice_row0)
                cols.append(c)
            dest.append(d)
            index.append(pc.index)
            which.append(firsts[key])
    if not first_views:
        return
    grouped_copy(first_views, sources)  # casts to the rollout dtype before bytes move
    if dup_views:
        torch._foreach_copy_(dup_views, dup_of)
    sums = bucket_checksums(probed, row0s=row0s, cols=cols)
    at = (torch.tensor(dest, device=partial.device), torch.tensor(index, device=partial.device))
    partial.index_put_(at, sums[torch.tensor(which, device=sums.device)], accumulate=True)


def grouped_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """`d.copy_(s)` for every pair, as one `torch._foreach_copy_` per (destination, source) dtype pair: a few fused
    launches on a GPU where one copy per weight was one launch each."""
    groups: dict[tuple, tuple[list, list]] = {}
    for d, s in zip(dst, src, strict=True):
        ds, ss = groups.setdefault((d.dtype, s.dtype, d.device, s.device), ([], []))
        ds.append(d)
        ss.append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)


def source_block(local: torch.Tensor, pc) -> torch.Tensor:
    block = local[pc.rows[0] : pc.rows[1]]
    if pc.cols is not None and block.dim() == 2:
        block = block[:, pc.cols[0] : pc.cols[1]]
    return block


def bucket_checksums(blocks: list[torch.Tensor], *, row0s: list[int], cols: list[range | None],
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """`block_checksum` of each of `blocks` (probed columns already taken, as there), in one pass over them all: a
    float64 vector on their device. What a sync dispatches for a bucket is then the same few operations whatever the
    number of its weights (one grouped copy into one buffer, one cast, one product, one segmented sum), where
    `block_checksum` launches several kernels per weight: on a GPU, where launches cost more than the probed bytes,
    that was most of a sync. The position weights are made on the host (numpy: no kernel per weight) and moved in
    two transfers. `cols`: each 2-D block's probed columns (`verify.probe_band`; the block holds only those), None
    for a vector. `dtype`: each value is rounded to it first, as the landing casts it."""
    if not blocks:
        return torch.zeros(0, dtype=torch.float64)
    device = blocks[0].device
    sizes = [b.numel() for b in blocks]
    buf = torch.empty(sum(sizes), dtype=dtype or torch.float64, device=device)
    views, off = [], 0
    for b, n in zip(blocks, sizes, strict=True):
        views.append(buf[off : off + n].view(b.shape))
        off += n
    grouped_copy(views, [b.detach() for b in blocks])
    values = buf if buf.dtype == torch.float64 else buf.double()  # scratch either way: weighted in place
    weights, segments = _bucket_weights(tuple(tuple(b.shape) for b in blocks), tuple(row0s), cols)
    values.mul_(torch.from_numpy(weights).to(device))
    out = torch.zeros(len(blocks), dtype=torch.float64, device=device)
    return out.index_add_(0, torch.from_numpy(segments).to(device), values)


def _bucket_weights(shapes: tuple[tuple[int, ...], ...], row0s: tuple[int, ...],
                    cols: list[range | None]) -> tuple[np.ndarray, np.ndarray]:
    """Each element's row x column weight (`block_checksum`'s), and the number of the block it belongs to (int32:
    the bucket's transient memory is a few bytes per probed element, which the sync's memory bound counts)."""
    sizes = [int(np.prod(shape[:1])) * (1 if len(shape) == 1 else len(c)) for shape, c in zip(shapes, cols, strict=True)]
    weights, segments = np.empty(sum(sizes)), np.empty(sum(sizes), dtype=np.int32)
    off = 0
    for i, (shape, row0, c, n) in enumerate(zip(shapes, row0s, cols, sizes, strict=True)):
        wr = 1.0 + ((row0 + np.arange(shape[0])) % 7) / 8.0
        if len(shape) == 1:
            weights[off : off + n] = wr
        else:
            np.outer(wr, 1.0 + (np.arange(c.start, c.stop) % 5) / 8.0, out=weights[off : off + n].reshape(shape[0], -1))
        segments[off : off + n] = i
        off += n
    return weights, segments


_verify_checksums = bucket_checksums  # the verification's own binding (benchmarks/reshard.py times each side apart)


class SliceDigest:
    """The verification's checksum of a slice read back from vLLM (`block_checksum` at row 0), one at a time, or
    (`many`, what `vllm_weights.readback` uses where it reads views of vLLM's parameters) many in one pass."""

    def __call__(self, values: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
        return block_checksum(values, row0=0, col_ids=cols)

    @staticmethod
    def takes(cols: torch.Tensor | None) -> bool:
        """Can `many` take a slice probed at `cols` (all columns, or a band)?"""
        return cols is None or band_start(cols) is not None

    def many(self, blocks: list[torch.Tensor], cols: list[torch.Tensor | None]) -> torch.Tensor:
        bands = [None if c is None else range(band_start(c), band_start(c) + len(c)) for c in cols]
        return _verify_checksums(blocks, row0s=[0] * len(blocks), cols=bands)


slice_digest = SliceDigest()
