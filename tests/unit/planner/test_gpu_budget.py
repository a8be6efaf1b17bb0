"""The GPU plan counts what a real node holds beyond the models, keeps a safety margin, and the README's 7B and
32B plan commands pass it: each command is read from the README and run with a folder holding the published
config.json of the model it names (the planner reads nothing else)."""

import re
import shlex

import pytest
from transformers import Qwen2Config

from hybrid_rl.config import load_config
from hybrid_rl.plan import EXIT_FITS, main
from hybrid_rl.plan_inputs import plan_for
from hybrid_rl.planner import trainer_memory
from hybrid_rl.planner.inputs import DeviceSpec
from hybrid_rl.planner.result import SAFETY_MARGIN
from hybrid_rl.planner.trainer_memory import NCCL_COMMUNICATOR_BYTES, NCCL_P2P_PER_PEER_BYTES, host_offload_bytes
from hybrid_rl.planner.units import GIB
from hybrid_rl.planner.vllm_memory import (
    measured_share,
    vllm_host_bytes,
    vllm_kept_asleep_bytes,
    vllm_utilization,
    vllm_weight_bytes,
)
from tests.conftest import REPO

# Published config.json values of Qwen2.5-7B-Instruct and Qwen2.5-32B-Instruct.
PUBLISHED = {
    "Qwen2.5-7B-Instruct": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                num_attention_heads=28, num_key_value_heads=4),
    "Qwen2.5-32B-Instruct": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                                 num_attention_heads=40, num_key_value_heads=8),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("configs")
    out = {}
    for name, shape in PUBLISHED.items():
        Qwen2Config(**shape, vocab_size=152064, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6,
                    max_position_embeddings=32768, architectures=["Qwen2ForCausalLM"]).save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def readme_plan_commands() -> list[list[str]]:
    """Every `python -m hybrid_rl.plan` command of the README that names a 7B or 32B model, as arguments."""
    text = REPO.joinpath("README.md").read_text().replace("\\\n", " ")
    cmds = []
    for line in text.splitlines():
        if "-m hybrid_rl.plan " in line and re.search(r"(7|32)B", line):
            args = shlex.split(line.split("-m hybrid_rl.plan", 1)[1].split("#")[0])
            cmds.append(args)
    return cmds


def test_the_readmes_7b_and_32b_plans_fit_with_the_safety_margin(model_dirs, capsys):
    cmds = readme_plan_commands()
    named = {m for args in cmds for m in PUBLISHED if f"model.path={m}" in args}
    assert named == set(PUBLISHED), cmds  # both models have a plan command in the README
    for args in cmds:
        args = [re.sub(r"^model\.path=(.*)$", lambda m: f"model.path={model_dirs[m.group(1)]}", a) for a in args]
        assert "--device-gib" in args and float(args[args.index("--device-gib") + 1]) < 80  # the real size
        assert main(args) == EXIT_FITS, capsys.readouterr().out
        out = capsys.readouterr().out
        assert re.search(r"FITS: peak .* to spare, beyond the .* GiB safety margin\)", out), out


def _plan(model_dirs, model: str, world: int, *overrides: str):
    cfg = load_config("grpo", [f"model.path={model_dirs[model]}", "data.train_files=[/nowhere.jsonl]", *overrides])
    return plan_for(cfg, world, device=DeviceSpec("cuda", int(79.6 * GIB)))


def test_what_a_gpu_holds_beyond_the_models_is_counted(model_dirs):
    plan = _plan(model_dirs, "Qwen2.5-7B-Instruct", 8, "rollout.tp=2", "model.activation_checkpointing=true")
    update = {(i.component, i.what.split(":")[0]): i.bytes for i in plan.phase("update").items}
    assert update[("process", "NCCL")] >= 4 * NCCL_COMMUNICATOR_BYTES  # FSDP + all-to-all, vLLM's TP group twice
    asleep = vllm_kept_asleep_bytes(plan.inputs)
    assert update[("vllm", "kept asleep")] == asleep > 0.5 * GIB  # graphs and buffers survive sleep mode
    assert update[("allocator", "fragmentation (5% of the trainer's)")] > 0
    assert plan.margin_bytes == int(SAFETY_MARGIN * 79.6 * GIB) and plan.usable_bytes < plan.device_bytes
    # vLLM's share holds its weights, KV cache and what it keeps asleep: the rollout phase stays within usable.
    assert plan.phase("rollout").total <= plan.usable_bytes
    assert not _plan(model_dirs, "Qwen2.5-7B-Instruct", 8, "rollout.tp=2", "rollout.enforce_eager=true",
                     "rollout.release=restart").phase("update").items[-1].what.startswith("kept")


def test_a_thin_margin_recommends_activation_checkpointing_first(model_dirs):
    plan = _plan(model_dirs, "Qwen2.5-7B-Instruct", 8, "rollout.tp=2")  # the old README command: no checkpointing
    assert plan.phase("update").total <= plan.device_bytes + 10 * GIB and not plan.fits
    assert plan.fixes[0].setting == "model.activation_checkpointing=true" and plan.fixes[-1].fits


def test_pinned_offload_host_memory_is_counted(model_dirs):
    plan = _plan(model_dirs, "Qwen2.5-7B-Instruct", 8, "rollout.tp=2", "offload.actor_optim=cpu")
    host = host_offload_bytes(plan.inputs)
    assert host == {"actor AdamW": plan.memory("actor").optim}
    assert any("host memory per rank" in n for n in plan.notes)


def test_the_all_to_alls_point_to_point_connections_are_reserved_by_world_size(model_dirs, monkeypatch):
    """NCCL connects the resharder's all-to-all to every peer inside the first sync, after vLLM measured its share:
    the plan counts them by world size (a typical figure per peer), and the measured share leaves room for them."""
    for world in (8, 32):
        plan = _plan(model_dirs, "Qwen2.5-7B-Instruct", world, "rollout.tp=2", "model.activation_checkpointing=true")
        for phase in ("sync", "rollout", "update"):
            got = {i.what: i.bytes for i in plan.phase(phase).items if i.component == "process"}
            assert got[f"NCCL p2p, {world - 1} peers (typical)"] == (world - 1) * NCCL_P2P_PER_PEER_BYTES
    free, total = 60 * GIB, 80 * GIB
    assert measured_share([free], total, state_to_come=0, world=1, reserve_bytes=0) == 0.75
    assert measured_share([free], total, state_to_come=0, world=32, reserve_bytes=0) == 0.73  # 31 x 32 MiB less
    share = vllm_utilization(plan.inputs)
    monkeypatch.setattr(trainer_memory, "NCCL_P2P_PER_PEER_BYTES", 0)
    assert share == vllm_utilization(plan.inputs) - 0.01  # the plan too: 31 peers: 0.97 GiB more kept outside vLLM


def test_a_lora_runs_sleep_level_1_backup_is_counted_in_host_memory(model_dirs):
    """LoRA sleeps vLLM at level 1: its weights are backed up in pinned host memory, each tensor rounded up to a
    power of two by torch's pinned allocator, and kept for the run: in the plan's host memory per rank."""
    lora = _plan(model_dirs, "Qwen2.5-7B-Instruct", 8, "rollout.tp=2", "model.lora.rank=16")
    host = vllm_host_bytes(lora.inputs)
    (what, backup), = host.items()
    weights = vllm_weight_bytes(lora.inputs.actor, 2, 2)
    assert weights < backup < 2 * weights and backup > 10 * GIB  # 7.1 GiB of weights on a TP rank: 13 GiB pinned
    assert any(what in n and "host memory per rank" in n for n in lora.notes)
    assert vllm_host_bytes(_plan(model_dirs, "Qwen2.5-7B-Instruct", 8, "rollout.tp=2").inputs) == {}  # level 2
    assert vllm_host_bytes(_plan(model_dirs, "Qwen2.5-7B-Instruct", 8, "rollout.tp=2", "model.lora.rank=16",
                                 "rollout.release=restart").inputs) == {}
