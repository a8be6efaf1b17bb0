"""Bad input fails fast: one message naming the file/line or key and what is allowed, exit code 2.

Each case is one `python -m hybrid_rl.train` process (no torchrun, no vLLM): not `slow`, so `make test` runs these
beside the other single-process tests.
"""

import json
import os
import subprocess
import sys

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
    (d / "ok.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "ground_truth": "1"}) + "\n" for i in range(40)))
    gpt2 = d / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    from hybrid_rl.model.tiny import TinySpec, build_tiny_model

    other_vocab = build_tiny_model(d / "other_vocab", TinySpec(vocab_size=300))  # a tokenizer of its own
    return {k: str(v) for k, v in {"dir": d, "gpt2": gpt2, "other_vocab": other_vocab,
                                   **{p.stem: p for p in d.glob("*.jsonl")}}.items()}


CASES = {
    "missing dataset file": (["data.train_files=[/nonexistent/train.jsonl]"], "/nonexistent/train.jsonl"),
    "malformed dataset line": (["data.train_files=[{malformed}]"], "malformed.jsonl line 2"),
    "row without the prompt": (["data.train_files=[{no_prompt}]"], "no_prompt.jsonl line 2"),
    "empty prompt": (["data.train_files=[{empty_prompt}]"], "empty_prompt.jsonl line 2"),
    "model folder that does not exist": (["model.path=/nonexistent/model"], "model.path='/nonexistent/model'"),
    "unknown architecture": (["model.path={gpt2}"], "GPT2LMHeadModel"),
    "unknown key": (["trainer.epochs=3"], "trainer.epochs: no such key"),
    "wrong type": (["trainer.total_steps=many"], "trainer.total_steps=many: expected int"),
    "value not allowed": (["algorithm.advantage=magic"], "choose one of: gae, grpo, rloo, reinforce_pp"),
    "unknown reward function": (["reward.fn=no_such_pkg.rewards:score"], "no_such_pkg"),
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
    assert r.returncode == 2 and "known recipes: cispo, dapo, dpo, dr_grpo, grpo, gspo" in r.stderr
