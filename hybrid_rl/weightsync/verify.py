"""Verification of a weight sync: what the senders checksum and what is read back from vLLM, compared.

Each sender computes a checksum of every piece it sends: a row- and column-weighted fp64 sum, in the destination
slice's coordinates, over a band of adjacent probe columns that moves on at each sync (so every column is checked
within ceil(width / band) syncs, at one or two cache lines a row). The receiving side reads back exactly what vLLM's
forward reads and checksums it the same way (`readback` in `vllm_weights.py`); the ranks then agree on the verdict.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from hybrid_rl.weightsync.layout import TPSlice


def probe_columns(ncols: int, max_cols: int, sync_index: int) -> torch.Tensor:
    """Columns checked this sync: all of them for small weights, else a band of `max_cols` adjacent columns that
    moves along with `sync_index`, so every column is checked within ceil(ncols / max_cols) syncs.

    Adjacent, not strided: reading a band of a row touches one or two cache lines, where columns spread along the
    whole row touched every line of it (the verification cost as much as reading the weight again, on both sides).
    """
    band = probe_band(ncols, max_cols, sync_index)
    return torch.arange(band.start, band.stop)


def probe_band(ncols: int, max_cols: int, sync_index: int) -> range:
    """`probe_columns` as a range (no tensor: the grouped sync makes none per weight)."""
    bands = max(1, -(-ncols // max_cols))
    start = sync_index % bands * max_cols
    return range(start, min(start + max_cols, ncols))


def band_start(cols: torch.Tensor) -> int | None:
    """The first column where `cols` (ascending, as `probe_columns` makes them) are adjacent; None otherwise."""
    ids = cols.tolist()  # host values, no tensor operation (the grouped read-back makes none per weight)
    return ids[0] if ids and ids[-1] - ids[0] == len(ids) - 1 else None


def take_columns(x: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """`x[:, cols]`: a view where `cols` are adjacent (`probe_columns`' bands), a gather otherwise."""
    start = band_start(cols)
    return x[:, cols] if start is None else x.narrow(1, start, len(cols))


def probe_for(ts: TPSlice, max_cols: int, sync_index: int) -> torch.Tensor | None:
    return None if len(ts.full_shape) == 1 else probe_columns(ts.shape[1], max_cols, sync_index)


def block_checksum(x: torch.Tensor, *, row0: int, col_ids: torch.Tensor | None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """Position-weighted fp64 sum of rows `x` placed at `row0` of a slice; a 0-d tensor on x's device.

    For 2-D weights `x` holds only the probed columns, whose slice column indices are `col_ids`.
    Weighting each element by its row and column makes swapped or shifted rows and columns
    visible, not only changed sums. `dtype`: the values as they land, rounded to it first (the sender's
    float32 weight, cast as the landing will cast it).
    """
    x = x.detach()
    wc = None if x.dim() == 1 else _col_weights(col_ids, x.device)
    rows = max(1, _checksum_elements(x.device) // (1 if x.dim() == 1 else max(1, x.shape[1])))
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for r in range(0, x.shape[0], rows):
        # A band is strided (a few columns of every row); a cast straight from it is 3x slower on CPU than a
        # same-dtype copy to contiguous memory and a cast there (`benchmarks/README.md`, "Weight sync vs a copy").
        part = x[r : r + rows].contiguous()
        if dtype is not None and part.dtype != dtype:
            part = part.to(dtype)
        part = part.double()
        wr = _position_weights(part.shape[0], (row0 + r) % 7, 7, x.device)
        total += part.dot(wr) if wc is None else part.mv(wc).dot(wr)
    return total


def _checksum_elements(device: torch.device) -> int:
    """Elements per block of `block_checksum`: on CPU its float64 copy stays in cache and under the size glibc
    maps fresh pages for (every block of more than 1 MiB would fault in its pages); a device takes a band at once."""
    return 1 << 16 if device.type == "cpu" else 1 << 24


def _col_weights(cols: torch.Tensor, device: torch.device) -> torch.Tensor:
    start = band_start(cols)
    if start is None:
        return 1.0 + (cols.to(device, torch.float64) % 5) / 8.0
    return _position_weights(len(cols), start % 5, 5, device)  # a band (`probe_columns`): cached by where it starts


@functools.lru_cache(maxsize=256)
def _position_weights(n: int, phase: int, modulus: int, device: torch.device) -> torch.Tensor:
    """1 + ((i + phase) % modulus) / 8 for i in 0..n-1: the same few vectors for every weight of a model."""
    return 1.0 + ((torch.arange(n, dtype=torch.float64, device=device) + phase) % modulus) / 8.0


HEAD = "lm_head"  # vLLM's output-head module in every supported architecture


def verify_targets(slices: list[TPSlice], *, tied: bool) -> list[tuple[int, TPSlice]]:
    """What post-sync verification reads back: (index of the sent slice, where vLLM's forward reads it).

    Every slice where it landed, plus, for tied word embeddings, the embedding as the *head* reads it:
    vLLM computes the logits from the head module (on CPU from a packed copy it derived from the weight),
    so a sync that updates the embedding but leaves the head stale must fail here, not pass on the
    embedding's bytes. The trainer (from its config) and the sidecar's server (from its model) build the
    same list.
    """
    out = [(i, ts) for i, ts in enumerate(slices)]
    if tied:
        out += [(i, replace(ts, hf_name=f"{HEAD}.weight", vllm_name=f"{HEAD}.weight", module=HEAD))
                for i, ts in enumerate(slices) if ts.hf_name == "model.embed_tokens.weight"]
    return out


def target_label(slices: list[TPSlice], index: int, ts: TPSlice) -> str:
    """A target's name in errors: the weight, and for a derived read what it was derived from."""
    src = slices[index].hf_name
    return ts.hf_name if ts.hf_name == src else f"{ts.hf_name} (tied to {src}; what vLLM's logits read)"


def checksums_match(expected: torch.Tensor, landed: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal up to fp64 summation-order noise (the values themselves are bit-identical)."""
    return (expected - landed).abs() <= 1e-9 * (expected.abs() + 1.0)


# ---------------------------------------------------------------------------------------------
# The transfer.
