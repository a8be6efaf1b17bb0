"""Per-platform defaults of the rollout engine, resolved on CPU for both platforms (the platform is an
argument: nothing about torch or CUDA is mocked)."""

import os

import pytest

from hybrid_rl.config import (
    CPU_KV_CACHE_GB,
    Config,
    ConfigError,
    RolloutConfig,
    RolloutDefaults,
    check_override,
    resolve_rollout,
    validate,
)
from hybrid_rl.utils.env import runtime_env, set_runtime_defaults


def test_cpu_keeps_the_test_settings():
    assert resolve_rollout(RolloutConfig(), "cpu") == RolloutDefaults(
        release="keep", enforce_eager=True, kv_cache_gb=CPU_KV_CACHE_GB, gpu_memory_utilization=None)


def test_cuda_defaults_to_vllms_fast_path():
    assert resolve_rollout(RolloutConfig(), "cuda") == RolloutDefaults(
        release="sleep", enforce_eager=False, kv_cache_gb=None, gpu_memory_utilization=None)  # None: measured at start


def test_explicit_values_win_on_both_platforms():
    r = RolloutConfig(enforce_eager=True, gpu_memory_utilization=0.6, kv_cache_gb=2.0, release="restart")
    assert resolve_rollout(r, "cuda") == RolloutDefaults("restart", True, 2.0, 0.6)
    assert resolve_rollout(r, "cpu") == RolloutDefaults("restart", True, 2.0, None)  # no GPU share on CPU


@pytest.mark.parametrize("platform,r,message", [
    ("cpu", RolloutConfig(release="sleep"), "rollout.release=sleep needs CUDA"),
    ("cpu", RolloutConfig(enforce_eager=False), "rollout.enforce_eager=false needs CUDA"),
    ("cuda", RolloutConfig(release="keep"), "rollout.release=keep holds vLLM's weights and KV cache"),
])
def test_what_a_platform_cannot_do_is_a_config_error(platform, r, message):
    with pytest.raises(ConfigError, match=message):
        resolve_rollout(r, platform)


def test_keep_on_cuda_is_fine_with_an_explicit_share_or_kv_cache():
    assert resolve_rollout(RolloutConfig(release="keep", gpu_memory_utilization=0.4), "cuda").release == "keep"
    assert resolve_rollout(RolloutConfig(release="keep", kv_cache_gb=8.0), "cuda").gpu_memory_utilization is None


@pytest.mark.parametrize("util", [1.5, -0.1])
def test_gpu_memory_utilization_is_validated(util):
    cfg = Config()
    cfg.model.path, cfg.data.train_files = "/m", ["/d.jsonl"]
    validate(cfg)
    cfg.rollout.gpu_memory_utilization = util
    with pytest.raises(ConfigError, match=r"rollout.gpu_memory_utilization=.* must be in \(0, 1\], or 0 for auto"):
        validate(cfg)


def test_enforce_eager_takes_null_for_auto_or_a_bool_on_the_command_line():
    for ok in ("rollout.enforce_eager=null", "rollout.enforce_eager=true", "rollout.enforce_eager=false"):
        check_override(ok)
    with pytest.raises(ConfigError, match="rollout.enforce_eager=auto: expected bool | None"):
        check_override("rollout.enforce_eager=auto")


def test_torch_compile_is_disabled_on_cpu_only(monkeypatch):
    assert runtime_env("cpu")["TORCH_COMPILE_DISABLE"] == "1"
    assert "TORCH_COMPILE_DISABLE" not in runtime_env("cuda")
    assert runtime_env("cuda")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the rest is the same everywhere
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    set_runtime_defaults(platform="cuda")
    assert "TORCH_COMPILE_DISABLE" not in os.environ
    set_runtime_defaults(platform="cpu")
    assert os.environ["TORCH_COMPILE_DISABLE"] == "1"


@pytest.mark.parametrize("override", [{"top_p": 0.9}, {"top_k": 20}])
def test_truncated_sampling_is_refused_in_both_modes(override):
    """vLLM's log-probs under top-p/top-k are renormalised over the kept set, the trainer's are not: refused."""
    for mode in ("colocated", "sidecar"):
        cfg = Config()
        cfg.model.path, cfg.data.train_files, cfg.rollout.mode = "/m", ["/t.jsonl"], mode
        for k, v in override.items():
            setattr(cfg.rollout, k, v)
        with pytest.raises(ConfigError, match="truncated sampling is not supported"):
            validate(cfg)
    cfg = Config()
    cfg.model.path, cfg.data.train_files = "/m", ["/t.jsonl"]
    cfg.rollout.top_k = 0  # vLLM's "off", as -1
    validate(cfg)


def test_malloc_threshold_is_taken_from_the_environment(monkeypatch):
    """HR_MALLOC_MMAP_THRESHOLD is the threshold handed to glibc's mallopt (1 MiB without it)."""
    import ctypes

    from hybrid_rl.utils import env

    calls = []

    class Libc:
        def mallopt(self, key, value):
            calls.append((key, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    monkeypatch.setenv("HR_MALLOC_MMAP_THRESHOLD", str(32 << 20))
    assert env.tune_malloc()
    monkeypatch.delenv("HR_MALLOC_MMAP_THRESHOLD")
    assert env.tune_malloc()
    thresholds = [v for k, v in calls if k == env._M_MMAP_THRESHOLD]
    assert thresholds == [32 << 20, 1 << 20]


def test_a_run_with_room_lets_glibc_keep_freed_buffers_unless_the_user_chose_a_threshold(monkeypatch):
    """`keep_freed_memory` (a plan with room, build.py) raises the mmap and trim thresholds; it leaves a threshold set
    by HR_MALLOC_MMAP_THRESHOLD alone."""
    import ctypes

    from hybrid_rl.utils import env

    calls = []

    class Libc:
        def mallopt(self, key, value):
            calls.append((key, value))
            return 1

        def prctl(self, option, *args):
            calls.append(("prctl", option, *args))
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    monkeypatch.delenv("HR_MALLOC_MMAP_THRESHOLD", raising=False)
    assert env.keep_freed_memory()
    assert calls[:2] == [(env._M_MMAP_THRESHOLD, 32 << 20), (env._M_TRIM_THRESHOLD, 1 << 30)]
    assert calls[2:] == [("prctl", 41, 1, 0, 0, 0)]  # PR_SET_THP_DISABLE
    calls.clear()
    monkeypatch.setenv("HR_MALLOC_MMAP_THRESHOLD", str(4 << 20))
    assert not env.keep_freed_memory() and calls == []


def test_a_black_box_agent_needs_sidecar_mode_and_no_tools_of_the_runs():
    cfg = Config()
    cfg.model.path, cfg.data.train_files, cfg.rollout.agent = "/m", ["/t.jsonl"], "my_pkg.agent:run"
    with pytest.raises(ConfigError, match="rollout.agent needs rollout.mode=sidecar"):
        validate(cfg)
    cfg.rollout.mode = "sidecar"
    validate(cfg)
    cfg.rollout.tools = ["python"]
    with pytest.raises(ConfigError, match="rollout.agent runs its own tools"):
        validate(cfg)
