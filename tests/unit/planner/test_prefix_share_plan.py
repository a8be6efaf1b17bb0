"""The memory plan of the prefix-shared layout (`trainer.prefix_share`): its attention rows and measured peak."""

import random

import torch

from hybrid_rl.model.forward import micro_batches
from hybrid_rl.model.loading import load_causal_lm, load_config
from hybrid_rl.planner.activations import shared_extra_rows, train_activations
from hybrid_rl.planner.param_count import ArchDims
from hybrid_rl.types import MATH_MAX_LEN, Sample
from tests.unit.planner.test_activations import LOW, _measured_activation_bytes


def _groups(vocab: int, n: int, prompts: list[int], responses: tuple[int, int], seed: int = 0) -> list[Sample]:
    rng, g, out = random.Random(seed), torch.Generator().manual_seed(seed), []
    for gid, p in enumerate(prompts):
        prompt = torch.randint(0, vocab, (p,), generator=g)
        for _ in range(n):
            r = rng.randint(*responses)
            out.append(Sample(len(out), prompt, torch.randint(0, vocab, (r,), generator=g), torch.zeros(r), False,
                              gid, gid, {}))
    return out


def _actual_extra_rows(tree) -> int:
    return sum(len(b) * (p + max(b)) - p - sum(b) for p, b in tree.segments if len(b) > 1)


def test_the_bound_on_extra_attention_rows_holds_for_random_groups():
    rng = random.Random(0)
    for seed in range(30):
        n = rng.randint(2, 16)
        samples = _groups(50, n, [rng.randint(1, 300) for _ in range(rng.randint(1, 5))], (1, rng.randint(1, 64)),
                          seed=seed)
        longest = max(s.length for s in samples)
        for mb in micro_batches(samples, 4096, share=True):
            assert mb.tree is not None
            tokens = mb.packed.num_tokens
            assert 0 < _actual_extra_rows(mb.tree) <= shared_extra_rows(tokens, n, longest, 64).keys


def test_the_plan_of_a_shared_micro_batch_bounds_its_measured_peak(tiny_models):
    path = tiny_models["qwen2"]
    dims = ArchDims.from_hf_config(load_config(path))
    samples = _groups(dims.vocab_size, 8, [48, 40, 60], (4, 16))
    mb = micro_batches(samples, 10**6, share=True)[0]
    assert mb.tree is not None
    tokens, responses = mb.packed.num_tokens, sum(s.response_len for s in samples)
    longest = max(s.length for s in samples)
    measured = _measured_activation_bytes(load_causal_lm(path), mb, train=True)
    plain = train_activations(dims, tokens, b=4, attention="sdpa", checkpointing=False, responses=responses,
                              math_len=min(longest, MATH_MAX_LEN))
    shared = train_activations(dims, tokens, b=4, attention="sdpa", checkpointing=False, responses=responses,
                               math_len=min(longest, MATH_MAX_LEN), extra_rows=shared_extra_rows(tokens, 8, longest, 16))
    assert plain.total < measured  # the tokens alone miss the branches' copied prompt keys
    # an upper bound: measured 1.89 here (the bound assumes one-token branches and prompts as long as the longest)
    assert LOW <= shared.total / measured <= 2.0, (shared.total, measured)
