"""Moving samples between ranks as a few flat tensors: the step's index to everyone, tokens to their trainer.

After generation every sample is held by one rank. Two things then travel:

* `gather_index`: one small int64 row per sample (uid, lengths, model tokens, group, truncated, part) to every
  rank, so that balancing, group statistics and metrics need no tokens (one all-gather).
* `send_to_owners`: each sample's tokens, rollout log-probs, token versions, loss mask and MoE routes to the rank
  that trains on it (four all-to-alls: headers, token ids with the versions and mask behind them, log-probs, routes
  as their raw bytes), never to the others.

Nothing is pickled and nothing loops over tokens in Python: at 4096 samples x 4k tokens the payload
is a few hundred MB of tensors that the backend moves at memory speed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hybrid_rl.distributed.collectives import all_gather_rows, all_to_all_rows
from hybrid_rl.types import BatchIndex, Sample

# Header columns of one sample on the wire.
(_UID, _PROMPT, _RESPONSE, _TRUNCATED, _GROUP, _RECORD, _LOGPROBS, _VERSIONS, _MASK, _PART, _MODEL,
 _ROUTES, _LAYERS, _TOP_K, _WIDTH) = range(15)
_COLUMNS = 15
_ROUTE_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # routes by their bytes per expert id


def _headers(samples: Sequence[Sample]) -> torch.Tensor:
    rows = [(s.uid, s.prompt_len, s.response_len, int(s.truncated), s.group, s.record_index,
             int(s.rollout_logprobs.shape[0]), int(s.token_versions.shape[0]), int(s.loss_mask.shape[0]), s.part,
             int(s.loss_mask.sum()) if s.loss_mask.numel() else s.response_len, *_route_shape(s.routes))
            for s in samples]
    return torch.tensor(rows, dtype=torch.int64).view(-1, _COLUMNS)


def gather_index(held: Sequence[Sample], size: int) -> BatchIndex:
    """The index of all `size` samples of the step, from the samples each rank holds. Collective."""
    rows = all_gather_rows(_headers(held))
    uid = rows[:, _UID]
    if rows.shape[0] != size or not torch.equal(torch.sort(uid).values, torch.arange(size)):
        raise RuntimeError(f"the ranks hold {rows.shape[0]} samples with uids {uid.tolist()[:10]}..., "
                           f"expected each of 0..{size - 1} exactly once")
    order = torch.argsort(uid)
    rows = rows[order]
    parts, model = rows[:, _PART], rows[:, _MODEL]
    return BatchIndex(rows[:, _PROMPT], rows[:, _RESPONSE], rows[:, _GROUP], rows[:, _TRUNCATED].bool(),
                      parts if bool(parts.any()) else None,
                      None if torch.equal(model, rows[:, _RESPONSE]) else model)


def send_to_owners(held: Sequence[Sample], owner: torch.Tensor, world: int,
                   fields_of: Callable[[int], Mapping[str, Any]]) -> list[Sample]:
    """Every held sample goes to rank `owner[uid]` (-1: to nobody); returns the samples this rank now owns.

    Collective. The received samples come back sorted by uid; their `fields` are looked up by record
    index with `fields_of` (every rank has the step's records, so they need not travel).
    """
    by_dest: list[list[Sample]] = [[] for _ in range(world)]
    for s in held:
        if (dest := int(owner[s.uid])) >= 0:
            by_dest[dest].append(s)
    headers = all_to_all_rows([_headers(part) for part in by_dest])
    ids = all_to_all_rows([_cat([t for s in part for t in (s.prompt_ids, s.response_ids, s.token_versions,
                                                           s.loss_mask.long())], torch.int64) for part in by_dest])
    logps = all_to_all_rows([_cat([s.rollout_logprobs for s in part], torch.float32) for part in by_dest])
    routes = all_to_all_rows([_cat([_bytes(s.routes) for s in part], torch.uint8) for part in by_dest])
    out = []
    for head, flat_ids, flat_lp, flat_routes in zip(headers, ids, logps, routes, strict=True):
        out += _unflatten(head, flat_ids, flat_lp, flat_routes, fields_of)
    return sorted(out, key=lambda s: s.uid)


def _route_shape(routes: torch.Tensor) -> tuple[int, int, int, int]:
    """(tokens, layers, top_k, bytes per id) of a sample's routes; zeros when it has none."""
    if not routes.numel():
        return 0, 0, 0, 0
    return (*routes.shape, routes.element_size())


def _bytes(routes: torch.Tensor) -> torch.Tensor:
    return routes.contiguous().view(-1).view(torch.uint8) if routes.numel() else torch.zeros(0, dtype=torch.uint8)


def _routes_of(row: list[int], raw: torch.Tensor) -> torch.Tensor:
    if not row[_ROUTES]:
        return torch.zeros(0, 0, 0, dtype=torch.uint8)
    return raw.view(_ROUTE_DTYPES[row[_WIDTH]]).view(row[_ROUTES], row[_LAYERS], row[_TOP_K])


def _cat(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(tensors).to(dtype) if tensors else torch.zeros(0, dtype=dtype)


def _unflatten(head: torch.Tensor, flat_ids: torch.Tensor, flat_lp: torch.Tensor, flat_routes: torch.Tensor,
               fields_of: Callable[[int], Mapping[str, Any]]) -> list[Sample]:
    h = head.tolist()
    id_parts = flat_ids.split([n for row in h for n in (row[_PROMPT], row[_RESPONSE], row[_VERSIONS], row[_MASK])])
    lp_parts = flat_lp.split([row[_LOGPROBS] for row in h])
    route_parts = flat_routes.split([row[_ROUTES] * row[_LAYERS] * row[_TOP_K] * row[_WIDTH] for row in h])
    return [Sample(row[_UID], id_parts[4 * k], id_parts[4 * k + 1], lp_parts[k], bool(row[_TRUNCATED]),
                   row[_GROUP], row[_RECORD], fields_of(row[_RECORD]), id_parts[4 * k + 2], id_parts[4 * k + 3].bool(),
                   row[_PART], _routes_of(row, route_parts[k]))
            for k, row in enumerate(h)]
