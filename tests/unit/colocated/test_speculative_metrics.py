"""The colocated workers record speculative rollout's acceptance per step, single-turn and multi-turn, from the counts
each generation carries (a scripted engine stands in for vLLM: its counts are what `vllm_engine` reads from vLLM's
per-request metrics, tests/engine/test_speculative.py)."""

from dataclasses import replace

from hybrid_rl.colocated.sampler import Sampler
from hybrid_rl.distributed.mesh import ParallelDims
from hybrid_rl.rollout.sampling import SamplingSettings
from hybrid_rl.types import Generation
from tests.unit.colocated.test_multi_turn_rollout import ScriptedEngine, _call, _records, _worker
from tests.unit.rollout.templates import tokenizer_for


class DraftingEngine:
    """Each response of a batch: 4 tokens, 6 drafted of which 3 accepted."""

    def generate(self, prompts, sampling, seeds, max_tokens=None):
        return [[Generation(i, [1, 2, 3, 4], [-0.5] * 4, "stop", spec_drafted=6, spec_accepted=3)
                 for _ in range(sampling.n)] for i in range(len(prompts))]


def test_a_step_records_drafted_accepted_and_their_ratio_only_when_speculative_is_on():
    tok = tokenizer_for("qwen2.5")
    records = _records(tok, 2)
    on = Sampler(DraftingEngine(), tok, ParallelDims(1, 0, 0, 1), SamplingSettings(8, 1.0, 1.0, -1, True), seed=0)
    metrics = on.generate(records, n=3, step=1, group_base=0).metrics
    assert metrics == {"rollout/spec_drafted": 36.0, "rollout/spec_accepted": 18.0, "rollout/spec_acceptance": 0.5}
    off = Sampler(DraftingEngine(), tok, ParallelDims(1, 0, 0, 1), SamplingSettings(8, 1.0, 1.0, -1), seed=0)
    assert off.generate(records, n=3, step=1, group_base=0).metrics == {}


class DraftingScriptedEngine(ScriptedEngine):
    def generate(self, prompts, sampling, seeds, max_tokens=None):
        return [[replace(g, spec_drafted=4, spec_accepted=1) for g in gens]
                for gens in super().generate(prompts, sampling, seeds, max_tokens)]


def test_a_multi_turn_step_counts_every_turns_drafts():
    tok = tokenizer_for("qwen2.5")
    calls = [_call("echo", {"text": "a"})] * 4
    worker, _ = _worker(tok, calls)
    worker.sampler.engine = DraftingScriptedEngine(tok, calls)
    worker.sampler.settings = SamplingSettings(200, 1.0, 1.0, -1, True)
    try:
        rollout = worker.generate(_records(tok, 2), n=2, step=1, group_base=0)
    finally:
        worker.close()
    # 4 trajectories, 2 turns each (a call, then an answer): 8 generations
    assert rollout.metrics["rollout/spec_drafted"] == 32.0 and rollout.metrics["rollout/spec_accepted"] == 8.0
    assert rollout.metrics["rollout/spec_acceptance"] == 0.25 and rollout.metrics["rollout/turns_mean"] == 2.0
