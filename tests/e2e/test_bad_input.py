"""Bad input fails fast: one message naming the file/line or key and what is allowed, exit code 2.

Each case is one `python -m hybrid_rl.train` process (no torchrun, no vLLM): not `slow`, so `make test` runs these
beside the other single-process tests.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def _train(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybrid_rl.train", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, **(env or {})))


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, tiny_models) -> dict[str, str]:
    d = tmp_path_factory.mktemp("bad")
    (d / "malformed.jsonl").write_text('{"prompt": "a", "ground_truth": "1"}\n{"prompt": "b", \n')
    (d / "no_prompt.jsonl").write_text('{"prompt": "a"}\n{"question": "b", "ground_truth": "2"}\n')
    (d / "empty_prompt.jsonl").write_text('{"prompt": "a"}\n{"prompt": "   "}\n')
    (d / "nested.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    (d / "ok.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "ground_truth": "1"}) + "\n" for i in range(40)))
    gpt2 = d / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    fp8 = d / "fp8"  # the tiny model's config with an FP8 quantization_config, as quantized hub checkpoints carry
    fp8.mkdir()
    config = json.loads((Path(tiny_models["qwen2"]) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (fp8 / "config.json").write_text(json.dumps(config))
    from hybrid_rl.model.tiny import TinySpec, build_tiny_model

    other_vocab = build_tiny_model(d / "other_vocab", TinySpec(vocab_size=300))  # a tokenizer of its own
    return {k: str(v) for k, v in {"dir": d, "gpt2": gpt2, "fp8": fp8, "other_vocab": other_vocab,
                                   **{p.stem: p for p in d.glob("*.jsonl")}}.items()}


CASES = {
    "missing dataset file": (["data.train_files=[/nonexistent/train.jsonl]"], "/nonexistent/train.jsonl"),
    "malformed dataset line": (["data.train_files=[{malformed}]"], "malformed.jsonl line 2"),
    "row without the prompt": (["data.train_files=[{no_prompt}]"], "no_prompt.jsonl line 2"),
    "empty prompt": (["data.train_files=[{empty_prompt}]"], "empty_prompt.jsonl line 2"),
    "model folder that does not exist": (["model.path=/nonexistent/model"], "model.path='/nonexistent/model'"),
    "unknown architecture": (["model.path={gpt2}"], "GPT2LMHeadModel"),
    "quantized checkpoint": (["model.path={fp8}"], "quantized checkpoint (quantization_config: fp8)"),
    "unknown key": (["trainer.epochs=3"], "trainer.epochs: no such key"),
    "wrong type": (["trainer.total_steps=many"], "trainer.total_steps=many: expected int"),
    "value not allowed": (["algorithm.advantage=magic"], "choose one of: gae, grpo, rloo, reinforce_pp"),
    "unknown reward function": (["reward.fn=no_such_pkg.rewards:score"], "no_such_pkg"),
    "deeply nested dataset row": (["data.train_files=[{nested}]"], "nested.jsonl line 2: the row is nested"),
    "reward naming a process function": (["reward.fn=subprocess:run"], "'subprocess:run': refused"),
    "teacher with another vocabulary": (["teacher.path={other_vocab}", "algorithm.opd_coef=1"],
                                        "has another vocabulary than model.path="),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_reported_clearly_with_exit_code_2(case, bad_files, tiny_models, tmp_path):
    overrides, expected = CASES[case]
    base = {"model.path": tiny_models["qwen2"], "data.train_files": f"[{bad_files['ok']}]",
            "trainer.output_dir": str(tmp_path / "out"), "reward.num_workers": "0"}
    for o in overrides:
        base[o.split("=", 1)[0]] = o.split("=", 1)[1].format(**bad_files)
    r = _train("--config-name=grpo", *[f"{k}={v}" for k, v in base.items()])
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr


def test_tp_that_does_not_divide_the_world_is_rejected_before_any_work(tiny_models, bad_files, tmp_path):
    r = _train("--config-name=grpo", f"model.path={tiny_models['qwen2']}", f"data.train_files=[{bad_files['ok']}]",
               "rollout.tp=3", env={"WORLD_SIZE": "2", "RANK": "0"})
    assert r.returncode == 2
    assert "rollout.tp=3 must be >= 1 and divide the number of ranks (2)" in r.stderr


def test_unknown_recipe_lists_the_known_ones():
    r = _train("--config-name=grpoo")
    assert r.returncode == 2 and "known recipes: cispo, dapo, dpo, dr_grpo, grpo, grpo_moe, gspo" in r.stderr


@pytest.mark.slow
def test_bad_config_at_four_ranks_is_said_once(tiny_models, bad_files, tmp_path):
    """Every rank finds the same bad key; only rank 0 says so (torchrun then adds its own failure summary)."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m",
                        "hybrid_rl.train", "--config-name=grpo", f"model.path={tiny_models['qwen2']}",
                        f"data.train_files=[{bad_files['ok']}]", "trainer.epochs=3"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert r.returncode != 0 and len(errors) == 1 and "trainer.epochs: no such key" in errors[0], out[-3000:]


def _ok_run(tiny_models, bad_files, out) -> list[str]:
    return ["--config-name=grpo", f"model.path={tiny_models['qwen2']}", f"data.train_files=[{bad_files['ok']}]",
            f"trainer.output_dir={out}", "reward.num_workers=0"]


def test_a_second_run_in_a_held_output_folder_exits_2_naming_the_holder(tiny_models, bad_files, tmp_path):
    """The holder is another process with a real lock on the folder, as a run's rank 0 holds it."""
    import socket

    from hybrid_rl.checkpoint.run_lock import hold_run_lock

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from hybrid_rl.checkpoint.run_lock import hold_run_lock\n"
                               "with hold_run_lock(sys.argv[1], rank=0, local_rank=0):\n"
                               "    print('held', flush=True); time.sleep(300)\n", str(tmp_path / "out")],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = _train(*_ok_run(tiny_models, bad_files, tmp_path / "out"))
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"host {socket.gethostname()}, pid {holder.pid}" in errors[0], r.stderr[-3000:]
    with hold_run_lock(tmp_path / "out", rank=0, local_rank=0):  # the holder's death released it
        pass


def test_a_checkpoint_of_another_algorithm_exits_2_before_loading(tiny_models, bad_files, tmp_path):
    import torch

    from hybrid_rl.checkpoint import Checkpointer
    from hybrid_rl.config import load_config, to_dict

    theirs = to_dict(load_config("grpo", [f"model.path={tiny_models['qwen2']}", f"data.train_files=[{bad_files['ok']}]",
                                          "algorithm.advantage=rloo"]))
    model = torch.nn.Linear(2, 2)
    Checkpointer(tmp_path / "out" / "checkpoints", keep_last=1, rank=0, world=1).save(
        3, components={"actor": (model, None)}, rank_state={}, shared_state={"config": theirs})
    r = _train(*_ok_run(tiny_models, bad_files, tmp_path / "out"))
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "algorithm.advantage: 'rloo' -> 'grpo'" in errors[0], r.stderr[-3000:]
    assert "step_3" in errors[0] and "Traceback" not in r.stderr

