"""Packed forward passes over samples: actor/reference log-probs, critic values, reward-model scores.

Every pass packs a micro-batch of samples into one row (no padding), runs the model once, and
scatters the response-token outputs back to `[b, T]`. Micro-batches are cut by a token budget over
*units* (a sample, or a preference pair that must stay together). Every rank runs the same number
of them, because FSDP's forward and backward are collective: the count is agreed with one
all-reduce, and a rank with fewer units than that count runs filler micro-batches (one two-token
sequence whose outputs are ignored and whose loss is zero) so that it still joins every collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hybrid_rl.data import PackedBatch, ResponseIndex, pack, split_by_token_budget
from hybrid_rl.data.tree import TreeLayout, pack_tree, shared_length
from hybrid_rl.distributed.collectives import all_reduce_max
from hybrid_rl.distributed.mesh import device
from hybrid_rl.model.attention import PACKED_SDPA
from hybrid_rl.model.logprobs import logits_to_logprobs
from hybrid_rl.model.routing_replay import Replay, replay_routes
from hybrid_rl.types import Sample


@dataclass(frozen=True)
class MicroBatch:
    """Samples `indices` packed into one row, with where their response tokens are.

    `indices` empty: a filler (see the module docstring); its outputs belong to no sample.
    """

    indices: list[int]
    packed: PackedBatch
    response: ResponseIndex
    # MoE routing replay: [packed tokens, layers, top_k] the experts each token uses, laid out like the tokens,
    # and [packed tokens] bool, which of them were recorded (the others route themselves); None: no replay
    routes: torch.Tensor | None = None
    known: torch.Tensor | None = None
    # prefix sharing: the row's groups as segments of [prompt, responses...] (`data/tree.py`); None: plain packing
    tree: TreeLayout | None = None

    @property
    def is_filler(self) -> bool:
        return not self.indices


def micro_batches(samples: list[Sample], token_budget: int, *,
                  units: Sequence[Sequence[int]] | None = None, routes: bool = False,
                  share: bool = False) -> list[MicroBatch]:
    """Cut `samples` into packed micro-batches of at most `token_budget` tokens, as many on every rank.

    `units` (default: every sample alone) are lists of sample indices that share a micro-batch.
    `routes`: each micro-batch carries its samples' MoE routes (`Sample.routes`) packed like their tokens.
    `share`: the samples of a group (same `group`, same prompt) become one unit packed prefix-shared
    (`data/tree.py`), counted as the prompt once plus their responses; a group whose shared length exceeds the
    budget is packed unshared, sample by sample. Not with `routes` or multi-sample `units` (preference pairs):
    those are packed unshared.
    A collective: every rank calls it, with its own samples.
    """
    single = units is None or all(len(u) == 1 for u in units)
    tree = share and not routes and single
    units = [[i] for i in range(len(samples))] if units is None else [list(u) for u in units]
    if tree:
        units = prefix_groups(samples, [u[0] for u in units], token_budget)
        lengths = [shared_length(samples[u[0]].prompt_len, [samples[i].response_len for i in u]) for u in units]
    else:
        lengths = [sum(samples[i].length for i in u) for u in units]
    count = int(all_reduce_max([len(split_by_token_budget(lengths, token_budget))])[0])
    groups = split_by_token_budget(lengths, token_budget, min_micro_batches=min(count, len(units))) if units else []
    if tree:
        out = [_tree_micro_batch(samples, [units[g] for g in sorted(group)]) for group in groups]
    else:
        out = [_micro_batch(samples, sorted(i for g in group for i in units[g])) for group in groups]
    if routes:
        out = [_with_routes(mb, samples) for mb in out]
    return out + [_filler() for _ in range(count - len(out))]


def _with_routes(mb: MicroBatch, samples: list[Sample]) -> MicroBatch:
    """`mb` with its samples' routes packed token for token; rows a sample did not record (a response's last token,
    which no rollout forward saw; a sample without routes) are unknown."""
    shaped = [samples[i].routes for i in mb.indices if samples[i].routes.numel()]
    if not shaped:
        return mb
    _, layers, top_k = shaped[0].shape
    dev = mb.packed.input_ids.device
    routes = torch.zeros(mb.packed.input_ids.shape[1], layers, top_k, dtype=shaped[0].dtype)
    known = torch.zeros(routes.shape[0], dtype=torch.bool)
    start = 0
    for i in mb.indices:
        r, n = samples[i].routes, samples[i].length
        rows = min(int(r.shape[0]), n) if r.numel() else 0
        routes[start: start + rows], known[start: start + rows] = r[:rows], True
        start += n
    return MicroBatch(mb.indices, mb.packed, mb.response, routes.to(dev), known.to(dev))


@contextmanager
def replayed(model, mb: MicroBatch, stats: Replay | None) -> Iterator[None]:
    """Forwards (and, for checkpointed layers, their recompute in backward) inside use `mb`'s routes; what the
    routers did is added to `stats`. Nothing happens without routes (dense models, fillers) or without `stats`."""
    if stats is None or mb.routes is None:
        yield
        return
    with replay_routes(model, mb.routes, mb.known) as r:
        yield
    stats.add(r)


def _micro_batch(samples: list[Sample], idx: list[int]) -> MicroBatch:
    dev = device()
    packed = pack([torch.cat([samples[i].prompt_ids, samples[i].response_ids]) for i in idx])
    packed = PackedBatch(packed.input_ids.to(dev), packed.position_ids.to(dev), packed.cu_seqlens.to(dev),
                         packed.max_seqlen, packed.seq_lens)
    resp = packed.response_index([samples[i].prompt_len for i in idx], [samples[i].response_len for i in idx])
    return MicroBatch(idx, packed, resp)


def prefix_groups(samples: list[Sample], order: list[int], token_budget: int) -> list[list[int]]:
    """`order`'s samples as units of the samples sharing a prompt (same `group`, equal `prompt_ids`), in order of
    first appearance; a group that does not fit `token_budget` shared is split into single samples."""
    by_key: dict[tuple[int, bytes], list[int]] = {}
    for i in order:
        s = samples[i]
        by_key.setdefault((s.group, s.prompt_ids.cpu().numpy().tobytes()), []).append(i)
    out = []
    for unit in by_key.values():
        fits = shared_length(samples[unit[0]].prompt_len, [samples[i].response_len for i in unit]) <= token_budget
        out += [unit] if fits or len(unit) == 1 else [[i] for i in unit]
    return out


def _tree_micro_batch(samples: list[Sample], units: list[list[int]]) -> MicroBatch:
    """Prefix-shared units packed as one row; where no unit has two samples, the plain packing (the same row)."""
    idx = [i for u in units for i in u]
    if all(len(u) == 1 for u in units):
        return _micro_batch(samples, idx)
    packed, layout, resp = pack_tree([(samples[u[0]].prompt_ids, [samples[i].response_ids for i in u])
                                      for u in units], device())
    return MicroBatch(idx, packed, resp, tree=layout)


def _filler() -> MicroBatch:
    dev = device()
    packed = pack([torch.zeros(2, dtype=torch.int64, device=dev)])
    return MicroBatch([], packed, packed.response_index([1], [1]))


def _forward(model, mb: MicroBatch, **kwargs):
    """The model on one packed row. The sequence boundaries go in as transformers' flash-attention kwargs: given
    them, its varlen path uses them as they are instead of recomputing them from `position_ids` in every layer
    (a `.max().item()` host sync each time); and as Python ints for the packed SDPA of installs without flash-attn
    (`model/attention.py`), which then reads no device tensor either. Other attentions ignore what is not theirs."""
    p = mb.packed
    if mb.tree is not None:  # the packed SDPA only (`model/attention.py`): flash-attn's varlen has no tree
        impl = getattr(getattr(model, "config", None), "_attn_implementation", PACKED_SDPA)
        if impl != PACKED_SDPA:
            raise ValueError(f"prefix-shared packing needs the attention {PACKED_SDPA!r}, the model has {impl!r}; "
                             "set trainer.prefix_share=false")
        return model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False, packed_tree=mb.tree,
                     packed_seq_lens=tuple(p.seq_lens), **kwargs)
    return model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False, cu_seq_lens_q=p.cu_seqlens,
                 cu_seq_lens_k=p.cu_seqlens, max_length_q=p.max_seqlen, max_length_k=p.max_seqlen,
                 packed_seq_lens=tuple(p.seq_lens), **kwargs)


def policy_logprobs(model, mb: MicroBatch, *, temperature: float, with_entropy: bool = False):
    """Log-probs `[b, T]` (and entropies) of the response tokens of one micro-batch, with the autograd graph.

    The LM head runs only at the positions that predict response tokens (`logits_to_keep`): prompt
    positions never produce vocabulary-sized logits.
    """
    r = mb.response
    logits = _forward(model, mb, logits_to_keep=r.logit_positions).logits[0]
    targets = mb.packed.input_ids[0, r.target_positions]
    out = logits_to_logprobs(logits, targets, temperature=temperature, with_entropy=with_entropy)
    if with_entropy:
        lp, ent = out
        return r.scatter(lp)[0], r.scatter(ent)[0]
    return r.scatter(out)[0]


def token_values(model, mb: MicroBatch) -> torch.Tensor:
    """Critic values `[b, T]` at the positions that predict each response token (the state before it)."""
    values = _forward(model, mb).logits[0, :, 0].float()
    return mb.response.scatter(values[mb.response.logit_positions])[0]


def sequence_scores(model, mb: MicroBatch) -> torch.Tensor:
    """Reward-model scores `[b]`: the score head at each sequence's last token.

    The model is called as a whole (FSDP's root hooks gather its weights); its own pooling picks one
    token of the packed row, so the head's per-token output is captured with a hook instead.
    """
    captured = {}
    handle = model.score.register_forward_hook(lambda _m, _i, out: captured.__setitem__("scores", out))
    try:
        _forward(model, mb)
    finally:
        handle.remove()
    last = mb.packed.cu_seqlens[1:].long() - 1
    return captured["scores"][0, last, 0].float()


@torch.no_grad()
def gather_per_token(fn: Callable[[MicroBatch], torch.Tensor], mbs: list[MicroBatch], n: int, width: int) -> torch.Tensor:
    """Run `fn` over micro-batches without grad and assemble `[n, width]` on the CPU, rows in sample order."""
    out = torch.zeros(n, width)
    for mb in mbs:
        vals = fn(mb).float().cpu()
        if not mb.is_filler:
            out[mb.indices, : vals.shape[1]] = vals
    return out
