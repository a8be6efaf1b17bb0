"""`model.dtype=auto` / `rollout.dtype=auto`: bf16 where the hardware computes in it, float32 on CPUs that would
emulate it (several times slower), resolved once when the config is loaded, for the platform the run targets."""

import logging

import pytest

from hybrid_rl.config import cpu_has_bf16, load_config, resolve_dtypes


def _cfg(tiny, *extra, platform="cpu"):
    return load_config("grpo", [f"model.path={tiny}", "data.train_files=[x.jsonl]", *extra], platform=platform)


@pytest.mark.parametrize(("flags", "expected"), [("fpu sse avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True),
                                                 ("fpu sse avx2 avx512f avx512_vnni", False)])
def test_bf16_instructions_are_read_from_cpuinfo(tmp_path, flags, expected):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert cpu_has_bf16(str(info)) is expected
    assert cpu_has_bf16(str(tmp_path / "missing")) is False


def test_auto_is_float32_on_a_cpu_without_bf16_and_says_so(tiny_models, caplog):
    cfg = _cfg(tiny_models["qwen2"])
    cfg.model.dtype = cfg.rollout.dtype = "auto"
    with caplog.at_level(logging.WARNING):
        resolve_dtypes(cfg, "cpu", has_bf16=False)
    assert (cfg.model.dtype, cfg.rollout.dtype) == ("float32", "float32")
    assert len([r for r in caplog.records if "no bf16 instructions" in r.getMessage()]) == 1


@pytest.mark.parametrize(("platform", "has_bf16"), [("cpu", True), ("cuda", False)])
def test_auto_is_bf16_where_the_hardware_has_it(tiny_models, platform, has_bf16):
    cfg = _cfg(tiny_models["qwen2"])
    cfg.model.dtype = cfg.rollout.dtype = "auto"
    resolve_dtypes(cfg, platform, has_bf16=has_bf16)
    assert (cfg.model.dtype, cfg.rollout.dtype) == ("bfloat16", "bfloat16")


def test_explicit_dtypes_are_kept_and_loading_resolves_for_the_target(tiny_models):
    cfg = _cfg(tiny_models["qwen2"], "model.dtype=float16", "rollout.dtype=float32")
    resolve_dtypes(cfg, "cpu", has_bf16=True)
    assert (cfg.model.dtype, cfg.rollout.dtype) == ("float16", "float32")
    gpu = _cfg(tiny_models["qwen2"], platform="cuda")  # a GPU run planned from this machine
    assert (gpu.model.dtype, gpu.rollout.dtype, gpu.model.frozen_storage_dtype) == ("bfloat16",) * 3
