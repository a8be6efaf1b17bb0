"""`python -m hybrid_rl.plan`: the table, the verdict and the exit code, from a recipe and overrides."""

import pytest

from hybrid_rl.plan import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT, EXIT_FITS, main


def _args(path: str, *extra: str) -> list[str]:
    # The planner reads config.json only: the data file need not exist.
    return ["--config-name=ppo", f"model.path={path}", "data.train_files=[/nowhere/train.jsonl]", "--world", "2",
            *extra]


def test_a_plan_that_fits_prints_every_phase_and_exits_0(tiny_models, capsys):
    assert main(_args(tiny_models["qwen2"], "--device-gib", "64")) == EXIT_FITS
    out = capsys.readouterr().out
    for phase in ("sync", "rollout", "old_logp", "reference", "critic", "update", "critic_update"):
        assert phase in out.splitlines()[2].split()
    assert "FITS: peak" in out and "AdamW states" in out and "KV cache" in out


def test_grpo_plan_has_no_old_logprob_pass_unless_asked_for(tiny_models, capsys):
    # One optimizer step per batch: the update's own forward gives the old log-probs.
    grpo = ["--config-name=grpo", f"model.path={tiny_models['qwen2']}", "data.train_files=[/x.jsonl]", "--world", "2"]
    assert main(grpo) == EXIT_FITS
    assert "old_logp" not in capsys.readouterr().out.splitlines()[2].split()
    assert main([*grpo, "algorithm.old_logp_pass=always"]) == EXIT_FITS
    assert "old_logp" in capsys.readouterr().out.splitlines()[2].split()


def test_a_plan_that_does_not_fit_names_the_largest_item_and_a_fix(tiny_models, capsys):
    args = _args(tiny_models["mid"], "--device", "cuda", "--device-gib", "3.0", "trainer.micro_batch_tokens=16384")
    assert main(args) == EXIT_DOES_NOT_FIT
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "largest item actor activations" in out
    fixes = out[out.index("cheapest in speed first"):]
    # Enough: the critic's update overflows too, and checkpointing (the actor's and the critic's blocks) fixes both.
    assert "critic_update needs" in out and "model.activation_checkpointing=true  (saves" in fixes
    command_line = fixes[fixes.index("all on one command line:"):].splitlines()[0]
    assert command_line.endswith("model.activation_checkpointing=true")


def test_lora_plan_has_no_reference_copy(tiny_models, capsys):
    assert main(_args(tiny_models["qwen2"], "--device-gib", "64", "model.lora.rank=8")) == EXIT_FITS
    out = capsys.readouterr().out
    assert "reference  params" not in out and "adapter parameters train" in out


@pytest.mark.parametrize("bad", [["--world", "0"], ["--device-gib", "lots"], ["--device", "tpu"],
                                 ["trainer.no_such_key=1"]])
def test_bad_flags_and_keys_exit_2_with_a_message(tiny_models, capsys, bad):
    assert main(_args(tiny_models["qwen2"], *bad)) == EXIT_BAD_INPUT
    assert "error:" in capsys.readouterr().err


def test_sidecar_plan_leaves_vllm_out_of_the_trainer_ranks_and_says_so(tiny_models, capsys):
    args = ["--config-name=grpo", f"model.path={tiny_models['qwen2']}", "data.train_files=[/x.jsonl]", "--world", "2",
            "--device-gib", "64"]
    assert main([*args, "rollout.mode=sidecar", "sidecar.slots=4", "rollout.bucket_mb=64"]) == EXIT_FITS
    out = capsys.readouterr().out
    table = out.split("total (predicted)")[0]
    assert "KV cache" not in table and "vllm" not in table, "the server's memory is not in the trainer ranks"
    assert "rollout.mode=sidecar: not counted above (the vLLM server is its own process)" in out
    assert "4 slots x 64 MiB = 0.25 GiB per server TP rank" in out
