"""The hybrid engine for real: torchrun ranks, FSDP2 on gloo, vLLM in-process, weights synced between them."""

from pathlib import Path

import pytest
import torch

from tests.conftest import VLLM_TP2, run_torchrun

WORKERS = Path(__file__).parent / "workers"
pytestmark = pytest.mark.slow


# One launch per TP size covers several architectures, tied and untied, one vLLM engine each (the first model
# over three optimizer steps, the others one): between them every supported architecture, tied and untied.
MODELS = {1: ["qwen2", "llama_tied_kv1", "qwen3_tied", "mistral"], 2: ["qwen2", "qwen2_tied", "mistral_tied", "llama"]}
LAYOUT_MODELS = ("qwen2", "llama_tied_kv1", "qwen3")  # TP slices against vLLM's own sharding (the TP-2 launch)
RELEASE = {1: "keep", 2: "restart"}
PACKED = torch.cpu._is_avx512_bf16_supported()  # the packed path needs AVX512-BF16 (CI has it)


def _parity(tiny_models, tmp_path: Path, tp: int) -> dict:
    args = ["--models", *[tiny_models[k] for k in MODELS[tp]], "--steps", "3", "1", "--tp", str(tp),
            "--release", RELEASE[tp]]
    if tp == 1 and PACKED:  # tied embeddings (as the small Qwen2.5 models): the head's packed copy must follow too
        args += ["--packed", tiny_models["qwen2_tied"]]
    if tp == 2:  # the verification must catch a tied head left stale (its refresh switched off)
        args += ["--broken-head", tiny_models["qwen3_tied"], "--layout", *[tiny_models[k] for k in LAYOUT_MODELS]]
    return run_torchrun(WORKERS / "parity.py", *args, tmp_path=tmp_path, timeout=1200)


# One launch per TP size, each read by two tests (the parity of every model, and the packed sync at TP 1 or the
# layout check at TP 2): a module's tests run on one worker (tests/conftest.py).
@pytest.fixture(scope="module")
def tp1_launch(tiny_models, tmp_path_factory) -> dict:
    return _parity(tiny_models, tmp_path_factory.mktemp("parity_tp1"), 1)


@pytest.fixture(scope="module")
def tp2_launch(tiny_models, tmp_path_factory) -> dict:
    return _parity(tiny_models, tmp_path_factory.mktemp("parity_tp2"), 2)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=VLLM_TP2)])
def test_vllm_reproduces_fsdp_model_after_each_sync(tiny_models, request, tp):
    models = [tiny_models[k] for k in MODELS[tp]]
    r = request.getfixturevalue(f"tp{tp}_launch")
    for name, path in zip(MODELS[tp], models, strict=True):
        steps = r[path]["steps"]
        assert len(steps) == (3 if path == models[0] else 1)  # three optimizer steps: the weights change between syncs
        for step in steps:
            assert step["greedy_equal"], f"{name}: vLLM greedy {step['vllm']} != HF greedy {step['hf']}"
            assert step["max_logprob_diff"] < 1e-4, name
            assert step["sync_path"] == "reload"  # vLLM's CPU backend repacks weights: no in-place path here
    # Each rank receives only its own TP slice: about 1/tp of the model (norms are replicated).
    model_bytes = sum(f.stat().st_size for f in Path(tiny_models["qwen2"]).glob("*.safetensors"))
    assert 0.9 / tp < r[models[0]]["steps"][0]["bytes"] / model_bytes < 1.05 / tp
    if tp == 2:
        broken = r["broken_head"]
        assert broken["raised"], "a stale tied head passed verification"
        assert "lm_head.weight (tied to model.embed_tokens.weight" in broken["message"], broken["message"]
        assert broken["mode_after_error"] == "train"


@pytest.mark.skipif(not PACKED, reason="the packed path needs AVX512-BF16 (CI has it)")
def test_packed_sync_lands_every_slice_in_the_weight_vllms_kernel_reads(tp1_launch):
    r = tp1_launch["packed"]
    for step in r["steps"]:
        assert step["sync_path"] == "packed"  # bf16 on AMX: no reload of vLLM's weight processing
        assert step["transport"] == "shared_memory"  # two ranks of one host (rollout.cpu_shm_sync)
        assert step["packed_slices_min"] >= step["slices"] // 2, step  # every projection, on every rank
        assert step["mismatched"] == 0, step  # bit-exact, read through the kernel itself
        assert step["max_logprob_diff"] < 0.1, step  # bf16 on both sides, different kernels


@pytest.mark.skipif(not PACKED, reason="the packed path needs AVX512-BF16 (CI has it)")
def test_packed_sync_at_world_1_casts_the_trainers_weights_as_it_lands_them(tiny_models, tmp_path):
    """One rank (the topology the README recommends for a 0.5B-class model on a CPU box): the slices are the
    trainer's float32 weights themselves, cast as they are packed into vLLM's weights (no buffer), still bit-exact
    through the kernel, tied head included."""
    r = run_torchrun(WORKERS / "parity.py", "--packed", tiny_models["qwen2_tied"], nproc=1, tmp_path=tmp_path,
                     timeout=600)["packed"]
    for step in r["steps"]:
        assert step["sync_path"] == "packed"
        assert step["buffer_bytes_max"] == 0, step  # no send buffer: the landing read the sources
        assert step["packed_slices_min"] >= step["slices"] // 2, step
        assert step["mismatched"] == 0, step
        assert step["max_logprob_diff"] < 0.1, step


@VLLM_TP2
def test_tp_slices_match_vllms_own_sharding_for_every_architecture(tiny_models, tp2_launch):
    r = tp2_launch["layout"]
    for path in (tiny_models[k] for k in LAYOUT_MODELS):
        assert r[path]["checked"] > 10
        assert r[path]["mismatched_total"] == 0, r[path]


@VLLM_TP2
def test_mode_switching_offload_verification_and_memory(tiny_models, tmp_path):
    r = run_torchrun(WORKERS / "switching.py", "--model", tiny_models["mid"], "--tp", "2", "--switches", "20",
                     tmp_path=tmp_path)
    # Training with train state offloaded to disk at every switch is bitwise the same as without.
    assert r["losses_disk"] == r["losses_resident"]
    # Offload round trip is exact, and host memory falls by about the offloaded bytes.
    assert r["offload_exact"]
    assert r["offload_bytes"] == r["state_bytes"]
    assert r["offload_rss_drop"] > 0.8 * r["offload_bytes"]
    # The resharder's own extra peak: about two buckets in flight plus one layer's slices; never the model.
    # RSS also counts what the allocator and gloo keep beside it: 8 MiB of slack (CI measured 6.6 MiB over the
    # buckets and the layer once, with another launch on the other core).
    layer_bytes = r["model_bytes_fp32"] / 12
    assert r["sync_stream_peak_extra"] < 3 * r["bucket_bytes"] + layer_bytes + 8 * 2**20, r
    assert r["sync_buffer_peak"] <= 2 * r["bucket_bytes"]
    # With vLLM's CPU reload path included, still well under a full copy of the model.
    assert r["sync_peak_extra"] < r["model_bytes_fp32"], r
    # A bucket corrupted on one rank is caught on every rank (tp=2: its TP partner too) with the same error naming
    # that rank, within seconds of each other, and the engine stays usable in train mode.
    assert r["corruption_caught"], "a rank went on after its partner's verification failed"
    assert len(set(r["corruption_messages"])) == 1, r["corruption_messages"]
    assert "did not land" in r["corruption_message"] and f"rank {r['bad_rank']}: " in r["corruption_message"]
    assert "rank 0: " not in r["corruption_message"]
    assert r["corruption_spread_s"] < 10, r["corruption_spread_s"]
    assert r["mode_after_error"] == "train"
    # 20 switches leak nothing: RSS flat after warm-up.
    rss = r["rss_after_switches"]
    assert rss[-1] - rss[4] < 16 * 2**20, [x // 2**20 for x in rss]
