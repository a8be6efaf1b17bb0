"""Speculative rollout's settings, its vLLM config in both deployments, and the acceptance counts it records (the
engine-level checks, greedy tokens, log-probs and the sampled distribution: tests/engine/test_speculative.py)."""

import json
import sys

import pytest

from hybrid_rl.config import Config, ConfigError, RolloutConfig, resolve_rollout, speculation, validate
from hybrid_rl.rollout.speculative import SpecTally, Speculation, counts_of, request_counts, spec_metrics
from hybrid_rl.sidecar.completions import parse_stream, request_body
from hybrid_rl.sidecar.vllm_server import ServerSpec, server_command
from hybrid_rl.types import Generation, Sampling


def _cfg(**rollout) -> Config:
    cfg = Config(rollout=RolloutConfig(**rollout))
    cfg.model.path, cfg.data.train_files = "/m", ["/t.jsonl"]
    return cfg


def test_off_by_default_and_ngram_maps_to_vllms_speculative_config():
    assert speculation(_cfg().rollout).vllm_config() is None
    cfg = _cfg(speculative="ngram", spec_tokens=3, spec_ngram_min=1, spec_ngram_max=5)
    validate(cfg)
    assert speculation(cfg.rollout).vllm_config() == {"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_min": 1, "prompt_lookup_max": 5}
    cfg = _cfg(speculative="siblings", spec_tokens=3, spec_ngram_min=1, spec_ngram_max=5)
    validate(cfg)  # vLLM loads the drafter by its path, the window in the class name
    assert speculation(cfg.rollout).vllm_config() == {
        "method": "custom_class", "num_speculative_tokens": 3,
        "model": "hybrid_rl.rollout.sibling_drafter.SiblingDrafter_1_5"}


@pytest.mark.parametrize("override,message", [
    ({"speculative": "eagle"}, r"rollout.speculative='eagle' is not allowed; choose one of: off, ngram, siblings"),
    ({"spec_tokens": 0}, r"rollout.spec_tokens=0 must be an integer in \[1, 16\]"),
    ({"spec_tokens": 17}, r"rollout.spec_tokens=17 must be an integer in \[1, 16\]"),
    ({"spec_ngram_min": 5, "spec_ngram_max": 4}, r"1 <= spec_ngram_min <= spec_ngram_max"),
    ({"spec_ngram_min": 0}, r"1 <= spec_ngram_min <= spec_ngram_max"),
])
def test_bad_values_are_one_config_error_naming_the_key(override, message):
    cfg = _cfg(**{"speculative": "ngram", **override})
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
    if "speculative" not in override:  # off: the lookahead is not read, so not refused
        validate(_cfg(**override))


def test_the_sidecar_server_command_line_carries_the_config_and_asks_for_per_request_counts():
    spec = dict(model_path="/m", tp=1, dtype="bfloat16", port=8100, max_model_len=640, seed=3, enforce_eager=True,
                log_path="/tmp/x.log", python=sys.executable)
    off = server_command(ServerSpec(**spec))
    assert "--speculative-config" not in off and "--per-request-spec-decode-metrics" not in off
    cmd = server_command(ServerSpec(**spec, speculation=Speculation("ngram", 5, 2, 3)))
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    assert cmd[cmd.index("--per-request-spec-decode-metrics") + 1] == "summary"
    cmd = server_command(ServerSpec(**spec, speculation=Speculation("siblings", 5, 2, 3)))  # the class by its path
    assert json.loads(cmd[cmd.index("--speculative-config") + 1])["model"] == (
        "hybrid_rl.rollout.sibling_drafter.SiblingDrafter_2_3")
    assert request_body([1], Sampling(max_tokens=2), 5)["stream_options"] == {"include_usage": True}


def test_a_streamed_answer_carries_the_servers_drafted_and_accepted_tokens():
    tokens = (b'data: {"choices": [{"token_ids": [1, 2], "logprobs": {"content": [{"logprob": -1}, {"logprob": -2}]},'
              b' "finish_reason": "length", "weight_versions": [{"version": "v", "start": 0, "end": 2}]}]}')
    usage = (b'data: {"choices": [], "metrics": {"speculative_decoding": {"num_draft_tokens": 8, '
             b'"num_accepted_draft_tokens": 3, "acceptance_histogram": [1, 0, 0, 1, 0]}}}')
    g = parse_stream([tokens, usage, b"data: [DONE]"], max_tokens=2, vocab=10)
    assert (g.token_ids, g.spec_drafted, g.spec_accepted) == ((1, 2), 8, 3)
    plain = parse_stream([tokens, b"data: [DONE]"], max_tokens=2, vocab=10)  # speculation off: no metrics
    assert (plain.spec_drafted, plain.spec_accepted) == (0, 0)
    assert counts_of(None) == (0, 0)


def test_acceptance_is_accepted_over_drafted_summed_over_responses():
    tally = SpecTally()
    tally.add([Generation(0, [1], [-1.0], "stop", spec_drafted=10, spec_accepted=4),
               Generation(1, [1], [-1.0], "stop", spec_drafted=6, spec_accepted=6)])
    assert tally.metrics() == {"rollout/spec_drafted": 16.0, "rollout/spec_accepted": 10.0,
                               "rollout/spec_acceptance": 10 / 16}
    assert tally.metrics(copies=2)["rollout/spec_drafted"] == 8.0  # a TP group's two ranks each counted them
    assert spec_metrics(0, 0)["rollout/spec_acceptance"] == 0.0


def test_sampled_speculative_rollouts_run_in_both_deployments_on_cpu():
    """Both put the corrected expand kernel in vLLM's processes (the sidecar run test drafts sampled on CPU servers)."""
    for mode in ("colocated", "sidecar"):
        for method in ("ngram", "siblings"):
            resolve_rollout(RolloutConfig(speculative=method, temperature=0.7, mode=mode), "cpu")


def test_ngram_is_refused_where_the_engine_restarts_on_cpu():
    r = RolloutConfig(speculative="ngram", temperature=0.0, release="restart")
    with pytest.raises(ConfigError, match="rollout.speculative=ngram with rollout.release=restart is refused on CPU"):
        resolve_rollout(r, "cpu")
    resolve_rollout(r, "cuda")
    resolve_rollout(RolloutConfig(speculative="siblings", temperature=0.0, release="restart"), "cpu")
    resolve_rollout(RolloutConfig(speculative="ngram", temperature=0.0), "cpu")  # keep: one start


def test_the_cpu_expand_kernel_writes_each_requests_value_in_the_outputs_dtype():
    """`vllm_cpu_kernels.expand`, the rejection sampler's expand as the Triton kernel defines it: float temperatures
    (0 replaced by 1), int top-k, over tokens given by cumulative counts; a request with no tokens writes none."""
    import torch

    from hybrid_rl.weightsync.vllm_cpu_kernels import expand

    out = torch.full((5,), float("nan"))
    expand(out, torch.tensor([0.7, 0.0, 0.3]), torch.tensor([2, 2, 5], dtype=torch.int32), 0, 1)
    assert torch.equal(out, torch.tensor([0.7, 0.7, 0.3, 0.3, 0.3]))
    k = torch.full((4,), -5, dtype=torch.int32)
    expand(k, torch.tensor([3, 0], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32), 0, 50)
    assert k.tolist() == [3, 50, 50, -5]


def test_the_in_process_engines_per_request_histogram_gives_the_accepted_tokens():
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    m = RequestSpecDecodeMetrics.new(4)
    for drafted, accepted in ((4, 0), (4, 3), (2, 2), (4, 4)):
        m.observe(num_draft_tokens=drafted, num_accepted=accepted)
    assert request_counts(m) == (14, 9) and request_counts(None) == (0, 0)
    assert request_counts(m)[1] == m.to_dict()["num_accepted_draft_tokens"]  # as the servers report it
