"""Group sequences by length: micro-batches under a token budget, and equal-count shards across DP ranks.

Both functions take lengths and return lists of indices into them, so they work for any per-sequence data.
They are pure and deterministic (ties are broken by index), so every rank computes the same answer from the
same lengths without communicating.

FSDP runs collectives in every forward and backward, so all ranks must run the same NUMBER of micro-batches
or training hangs. A trainer therefore calls `split_by_token_budget` once, all-reduces the MAX of
`len(result)` across ranks, and calls it again with `min_micro_batches=` that max.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)
_warned_budgets: set[int] = set()

# Karmarkar-Karp state: (negated spread, tie-breaker, [(token sum, indices)] with one entry per rank).
_Partial = tuple[int, int, list[tuple[int, list[int]]]]


def split_by_token_budget(lengths: Sequence[int], max_tokens: int, *, min_micro_batches: int = 1) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most `max_tokens` tokens, as even as possible.

    The number of micro-batches is what first-fit-decreasing needs (or `min_micro_batches`, if more). Within
    that number, the longest-first greedy split onto the lightest micro-batch is used when it fits the budget
    (even micro-batches); otherwise the first-fit-decreasing packing itself, its fullest micro-batches halved
    until there are enough. A sequence longer than `max_tokens` gets a micro-batch of its own (warned once):
    refusing it would stop a run on one long rollout, and its memory cost is bounded by the max sequence length.

    Returns:
        Micro-batches of indices, each sorted, ordered by their smallest index.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not lengths:
        return []
    if not 1 <= min_micro_batches <= len(lengths):
        raise ValueError(
            f"min_micro_batches={min_micro_batches} for {len(lengths)} sequences; expected 1 to {len(lengths)} "
            "(every micro-batch needs at least one sequence)"
        )
    oversized = [i for i, n in enumerate(lengths) if n > max_tokens]
    if oversized:
        _warn_oversized_once(max_tokens, max(lengths[i] for i in oversized))

    packed = _first_fit_decreasing(lengths, max_tokens)
    count = max(len(packed), min_micro_batches)
    even = _longest_first(lengths, count)
    fits = all(len(group) == 1 or sum(lengths[i] for i in group) <= max_tokens for group in even)
    groups = even if fits else _split_fullest(packed, lengths, count)
    return sorted((sorted(group) for group in groups), key=lambda group: group[0])


def balance_across_ranks(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Split indices into `world` groups of equal COUNT whose token sums are as equal as possible.

    Karmarkar-Karp largest differencing with the equal-size constraint: the sorted lengths are cut into
    chunks of `world` (one sequence per rank each), and the two partial partitions with the widest spread
    are merged repeatedly, heaviest group of one with the lightest of the other.

    Returns:
        `world` groups of `len(lengths) // world` indices; group r is rank r's. Each group is sorted.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if len(lengths) % world:
        raise ValueError(
            f"{len(lengths)} sequences cannot be split equally across {world} ranks; expected a multiple of "
            f"{world} (make the global batch, prompts x samples per prompt, divisible by the data-parallel size)"
        )
    if not lengths:
        return [[] for _ in range(world)]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap: list[_Partial] = []
    for tie, start in enumerate(range(0, len(order), world)):
        _push(heap, [(lengths[i], [i]) for i in order[start : start + world]], tie)
    tie = len(heap)
    while len(heap) > 1:
        first, second = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        heavy_first = sorted(first, key=lambda g: (-g[0], g[1]))
        light_first = sorted(second, key=lambda g: (g[0], g[1]))
        _push(heap, [(a[0] + b[0], a[1] + b[1]) for a, b in zip(heavy_first, light_first, strict=True)], tie)
        tie += 1
    groups = [sorted(ids) for _, ids in heap[0][2]]
    return sorted(groups, key=lambda group: group[0])


def balance_units(lengths: Sequence[int], world: int) -> list[list[int]]:
    """`balance_across_ranks` for any number of units: counts per rank differ by at most one.

    Zero-length placeholders pad the count to a multiple of `world` and are dropped afterwards, so a
    rank may get one unit fewer (or none, with fewer units than ranks).
    """
    padded = list(lengths) + [0] * (-len(lengths) % world)
    return [[i for i in group if i < len(lengths)] for group in balance_across_ranks(padded, world)]


def _push(heap: list[_Partial], groups: list[tuple[int, list[int]]], tie: int) -> None:
    sums = [s for s, _ in groups]
    # Widest spread first; `tie` (creation order) keeps the result independent of list comparison.
    heapq.heappush(heap, (-(max(sums) - min(sums)), tie, groups))


def _first_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((b for b, load in enumerate(loads) if load + lengths[i] <= max_tokens), None)
        if target is None:
            bins.append([i])
            loads.append(lengths[i])
        else:
            bins[target].append(i)
            loads[target] += lengths[i]
    return bins


def _longest_first(lengths: Sequence[int], count: int) -> list[list[int]]:
    """Each sequence, longest first, onto the currently lightest group (LPT scheduling)."""
    heap = [(0, g) for g in range(count)]
    groups: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + lengths[i], g))
    return [group for group in groups if group]


def _split_fullest(bins: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """Halve the heaviest splittable bin until there are `count` bins (each half still fits the budget)."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        fullest = max(splittable, key=lambda b: (sum(lengths[i] for i in bins[b]), -b))
        halves = _longest_first([lengths[i] for i in bins[fullest]], 2)
        bins[fullest : fullest + 1] = [[bins[fullest][j] for j in half] for half in halves]
    return bins


def _warn_oversized_once(max_tokens: int, longest: int) -> None:
    # Once per budget and process: the same budget meets long rollouts at many steps.
    if max_tokens in _warned_budgets:
        return
    _warned_budgets.add(max_tokens)
    logger.warning(
        "sequences longer than the micro-batch budget max_tokens=%d (longest %d) each get a micro-batch of their "
        "own; raise the budget or lower the max sequence length to keep micro-batches within it",
        max_tokens,
        longest,
    )
