"""A run stopped after step 2 and resumed gives bitwise the same steps 3 and 4 as an uninterrupted run.

The full fine-tuning case runs on 4 ranks with `rollout.tp=2`: two data-parallel vLLM groups of two
tensor-parallel ranks each, as GPU users run (TP 2-8 with several DP groups), with the check that vLLM's
sampling log-probs match the trainer's recomputation; it replicates the model on every rank (`trainer.shard_size=1`,
HSDP), the 2-rank cases shard it. The LoRA and 8-bit AdamW cases run on 2 ranks, in one launch,
with a mixture of experts (tiny Qwen3-MoE, the `grpo_moe` recipe: rollout routing replay, activation checkpointing)
stopped after step 1 and resumed for step 2, whose exported weights equal the uninterrupted run's bit for bit.
"""

import json
import re
from pathlib import Path

import pytest

from tests.conftest import VLLM_TP2, run_torchrun
from tests.e2e.conftest import tiny_overrides

WORKER = Path(__file__).parent / "workers" / "run_recipes.py"
pytestmark = pytest.mark.slow
COMPARED = ("reward/mean", "reward/std", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/kl",
            "response/length_mean", "rollout/logprob_diff_mean")


def _metrics(path: Path) -> dict[int, dict]:
    return {d["step"]: d for d in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())}


# The two-rank variants share one launch (their nine runs one after another, each its own build -> fit -> close):
# torchrun starts less. The 8-bit run goes first: its memory check reads the process's peaks, which earlier runs in
# the same process could only raise.
SHARED = ("adamw8bit", "lora", "moe")
LAYOUT = {"full": (4, 2), "lora": (2, 1), "adamw8bit": (2, 1), "moe": (2, 1)}  # variant -> (ranks, rollout.tp)
STEPS = {"moe": 2}  # variant -> total steps (stopped and checkpointed halfway); 4 unless named
MOE_LORA = "[q_proj,k_proj,v_proj,o_proj,experts]"  # LoRA on a mixture of experts: attention and the fused experts


def _runs(variant: str, tiny_models, task_files, root: Path) -> list[dict]:
    """Straight for 4 steps (`STEPS`); the same run stopped halfway and resumed to the end (in `root / variant`)."""
    steps = STEPS.get(variant, 4)
    # A reward whose scores vary even for a random model, so every step really updates the weights.
    common = {"trainer.seed": 3, "trainer.save_every": steps // 2, "data.val_files": "[]",
              "rollout.tp": LAYOUT[variant][1], "reward.fn": "tests.e2e.rewards:length_parity",
              # The tiny model fits every rank, so auto would replicate it everywhere: the 4-rank run takes that
              # layout (HSDP, every rank whole; the sync takes slices from the rank's own copy), the 2-rank ones shard
              # each weight over both ranks (the sync's all-to-all between shards).
              "trainer.shard_size": 1 if variant == "full" else 2}
    if variant == "lora":  # the checkpoint must save and restore the adapter (and its optimizer state); vLLM gets
        # the adapter itself (model.lora.sync=adapter, the default): the log-prob check below covers it at TP 1
        common.update({"model.lora.rank": 8, "optim.lr": "1e-3"})
    if variant == "adamw8bit":  # torchao's 8-bit moments (codes and block scales) are saved and restored exactly
        common.update({"optim.name": "adamw8bit", "optim.lr": "1e-3"})
    if variant == "moe":  # GSPO's tight clip: a larger step, so that step 2 trains on what step 1 changed
        common.update({"optim.lr": "1e-3"})
    out, model = root / variant, tiny_models["qwen3_moe" if variant == "moe" else "qwen2"]
    recipe = "grpo_moe" if variant == "moe" else "grpo"
    return [
        {"name": f"{variant}/straight", "recipe": recipe,
         "overrides": tiny_overrides(model, task_files, out / "straight", **common, **{"trainer.total_steps": steps})},
        {"name": f"{variant}/first_half", "recipe": recipe,
         "overrides": tiny_overrides(model, task_files, out / "resumed",
                                     **common, **{"trainer.total_steps": steps // 2})},
        {"name": f"{variant}/second_half", "recipe": recipe,
         "overrides": tiny_overrides(model, task_files, out / "resumed",
                                     **common, **{"trainer.total_steps": steps, "trainer.resume": "auto"})},
    ]


@pytest.fixture(scope="module")
def shared_launch(tiny_models, task_files, tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("resume")
    runs = [r for variant in SHARED for r in _runs(variant, tiny_models, task_files, root)]
    # LoRA on a mixture of experts (attention and expert adapters, merged sync: what config allows), two steps, no
    # resume; each fused expert tensor sharded over both ranks along the experts, as its adapter's merge is.
    runs.append({"name": "moe_lora", "recipe": "grpo_moe", "overrides": tiny_overrides(
        tiny_models["qwen3_moe"], task_files, root / "moe_lora", **{"data.val_files": "[]", "optim.lr": "1e-3",
                                                                    "reward.fn": "tests.e2e.rewards:length_parity",
                                                                    "trainer.shard_size": 2,
                                                                    "model.lora.rank": 8, "model.lora.sync": "merged",
                                                                    "model.lora.target_modules": MOE_LORA})})
    return root, run_torchrun(WORKER, json.dumps(runs), nproc=2, tmp_path=root, timeout=900)


@pytest.mark.parametrize("variant", [pytest.param("full", id="full-dp2-tp2", marks=VLLM_TP2), "lora", "adamw8bit",
                                     "moe"])
def test_resumed_run_matches_uninterrupted_run_bitwise(tiny_models, task_files, tmp_path, request, variant):
    if variant in SHARED:
        root, result = request.getfixturevalue("shared_launch")
    else:
        root = tmp_path
        result = run_torchrun(WORKER, json.dumps(_runs(variant, tiny_models, task_files, root)),
                              nproc=LAYOUT[variant][0], tmp_path=root, timeout=900)
    mine = {name: r for name, r in result.items() if name.startswith(f"{variant}/")}
    assert len(mine) == 3 and all(r["ok"] for r in mine.values()), result
    straight, resumed = _metrics(root / variant / "straight"), _metrics(root / variant / "resumed")
    written = [p for p in (root / variant / "resumed").rglob("*") if not p.is_symlink()]
    assert any(p.name == "shared.pt" for p in written)
    open_to_others = [f"{p} {oct(p.stat().st_mode)}" for p in written if p.stat().st_mode & 0o077]
    assert not open_to_others, f"the run's files are readable by other users (umask 077): {open_to_others[:5]}"
    steps = STEPS.get(variant, 4)
    assert sorted(resumed) == list(range(1, steps + 1))  # no step lost or logged twice
    assert straight[steps]["actor/entropy"] != straight[1]["actor/entropy"], "the policy did not change: vacuous"
    for step in range(1, steps + 1):  # vLLM (each TP group) samples what the trainer computes (float32 both sides)
        assert straight[step]["rollout/logprob_diff_max"] < 1e-3, straight[step]
    for step in range(steps // 2 + 1, steps + 1):
        compared = [k for k in COMPARED if k in straight[step]] + (["moe/router_agreement"] if variant == "moe" else [])
        assert len(compared) >= 6, compared
        for key in compared:
            assert resumed[step][key] == straight[step][key], f"step {step} {key}: {resumed[step][key]} != " \
                                                               f"{straight[step][key]}"
    if variant == "moe":  # the last step's weights, as exported (every expert of every layer), bit for bit
        import torch
        from safetensors.torch import load_file

        def weights(run: str) -> dict[str, torch.Tensor]:
            return {k: v for f in sorted((root / variant / run / "export").glob("*.safetensors"))
                    for k, v in load_file(f).items()}

        a, b = weights("straight"), weights("resumed")
        assert any(".mlp.experts.7.down_proj." in k for k in a) and sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    if variant == "adamw8bit":  # the planner counts the 8-bit state: the update phase's peak within 15% of its plan
        for step in (2, 3, 4):
            ratio = straight[step]["memory/update/peak_gib"] / straight[step]["memory/update/plan_gib"]
            assert 0.85 <= ratio <= 1.15, (step, ratio)


def test_lora_on_a_mixture_of_experts(shared_launch, tiny_models):
    """Attention and expert adapters on a tiny Qwen3-MoE (peft's wrappers of the fused expert tensors): the merged
    weights (each rank merging the experts it holds, sent one per expert and projection) land in vLLM and are
    verified at every sync; after step 1 changed the adapters, vLLM samples what the trainer computes; the export
    is the base with only the adapted attention projections and experts changed, and the exported adapter on the base
    (peft) gives the merged export's logits."""
    import torch
    from safetensors.torch import load_file

    root, result = shared_launch
    assert result["moe_lora"]["ok"], result["moe_lora"]
    steps = _metrics(root / "moe_lora")
    assert sorted(steps) == [1, 2]
    for s in steps.values():
        assert s["rollout/logprob_diff_max"] < 1e-3 and s["moe/router_agreement"] == 1.0, s

    def weights(folder: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    base, tuned = weights(Path(tiny_models["qwen3_moe"])), weights(root / "moe_lora" / "export")
    assert sorted(base) == sorted(tuned)
    changed = {k for k in base if not torch.equal(base[k].float(), tuned[k].float())}
    adapted = r"(self_attn\.[qkvo]_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$"
    assert all(re.search(adapted, k) for k in changed), sorted(changed)[:5]
    for layer in range(2):  # both kinds trained in every layer, the experts on both ranks (experts 0-3, 4-7)
        mine = [k for k in changed if k.startswith(f"model.layers.{layer}.")]
        assert any("self_attn" in k for k in mine), mine
        assert {int(k.split(".")[5]) // 4 for k in mine if ".experts." in k} == {0, 1}, mine
    from peft import PeftModel  # the adapter alone, as exported, is the merged export on plain transformers and peft
    from transformers import AutoModelForCausalLM

    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_models["qwen3_moe"]),
                                        str(root / "moe_lora" / "export" / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(str(root / "moe_lora" / "export"))
    ids = torch.arange(5, 29).reshape(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(adapter(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
