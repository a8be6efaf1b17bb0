"""The manual's commands are tests: every command in the ```bash blocks of README.md and docs/ runs here, in that
order (README first, then docs/ by path), as a user would copy it, with
small substitutions (a tiny model for the model folder, 4 CPU ranks for 8 GPUs, a few steps for 200), or is named
below with the test that runs it. A README edit that breaks a command, or adds one this file does not know, fails.

The GPU recipe ("Running a real recipe on GPUs") runs in order in one folder, as the user's shell would: `hf
download` is checked offline (its arguments must parse; nothing is downloaded), the GSM8K conversion runs on a
small parquet with GSM8K's columns at the path the README names, the planner's command plans the 7B shape (a
config.json with Qwen2.5-7B's published shape) and must say it fits, and the training command runs with its own
keys (rollout.tp=2, train and validation files) on 4 ranks with the tiny model.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_rl.distributed.mesh import free_port
from tests.conftest import REPO, VLLM_TP2

sys.path.insert(0, str(REPO / "benchmarks"))
import qwen_shapes  # noqa: E402 - Qwen2.5's published configs, as the benchmarks build their model folders

pytestmark = pytest.mark.slow

README = REPO / "README.md"
# The README, then every docs page: a command moved from one to the other keeps being run.
MANUAL = [README, *sorted((REPO / "docs").rglob("*.md"))]
CPU_WORLD = 4  # the README's 8 GPUs become 4 CPU ranks (2 cores: more would only be slower)
# Commands the README shows that this file does not run, and the test that does (or why none can).
COVERED_ELSEWHERE = {
    "make install": "runs first in `make test` itself; its decisions: tests/integration/test_install_scripts.py",
    "make install-sidecar": "runs first in `make test` (install-all); decisions: "
                            "tests/integration/test_install_scripts.py",
    "make install-sandbox": "runs first in `make test` (install-all); decisions: "
                            "tests/integration/rewards/test_install_sandbox.py",
    "make test": "this suite",
    "make test-fast": "tests/unit, a subset of this suite",
    "make bench": "tests/e2e/test_benchmarks_smoke.py runs every benchmark script in its smoke mode",
    "python benchmarks/distill.py": "tests/e2e/test_benchmarks_smoke.py runs it in its smoke mode (the full run is "
                                    "30 steps of a real model)",
    "make demo": "tests/e2e/test_demo.py (40 steps); TASK=tools: tests/e2e/test_tools_demo.py (5 steps)",
    "make lint": "not run by `make test` (ruff + import-linter; the layer rules: tests/unit/*/test_import_rule.py)",
    "make test-gpu": "needs a CUDA GPU, which CI lacks: tests/gpu, run on an H200 on 2026-11-27 (README, \"What has and "
                     "has not run on a GPU\"); here, tests/conftest.py keeps it out of `make test`",
    "etcd": "tests/sidecar start their own etcd on free ports (the README's line is the stock etcd command)",
    "python hybrid_rl.model.smollm2": "the `smollm2` fixture of tests/conftest.py builds it (tests/e2e/test_smollm2.py)",
}
# Recipes whose training command runs for real elsewhere (its model is not a tiny one): here its keys are checked.
RECIPES_RUN_ELSEWHERE = {"smollm2_arithmetic": "tests/e2e/test_smollm2.py (a 1-step run of the recipe on SmolLM2)"}
# Appended to every training command that runs here: the run's shape stays the README's, its size shrinks.
SMALL = ["rollout.n=2", "rollout.max_new_tokens=8", "data.prompts_per_step=4", "data.val_prompts=4",
         "trainer.micro_batch_tokens=512", "reward.num_workers=1", "trainer.show_progress=false", "rollout.bucket_mb=1"]
REPLACE = {"trainer.total_steps": "2", "trainer.save_every": "1"}


def readme_commands(text: str | None = None) -> list[str]:
    """Every command of the manual's ```bash blocks, continuation lines joined, comments dropped."""
    texts = [p.read_text() for p in MANUAL] if text is None else [text]
    out = []
    for block in [b for t in texts for b in re.findall(r"^```bash\n(.*?)^```", t, flags=re.S | re.M)]:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                out.append(" ".join(line.split()))
    return out


def split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """`A=1 B=2 cmd args` -> ({A: 1, B: 2}, [cmd, args])."""
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        k, v = argv[0].split("=", 1)
        env[k], argv = v, argv[1:]
    return env, argv


def flag(argv: list[str], name: str) -> str | None:
    """The value of torchrun's `--name=value` (or `--name value`)."""
    for i, a in enumerate(argv):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name:
            return argv[i + 1]
    return None


def program(argv: list[str]) -> str:
    """What a command runs: 'make demo', 'hf download', 'torchrun hybrid_rl.train', 'python hybrid_rl.plan', ..."""
    argv = split_env(argv)[1]
    exe = Path(argv[0]).name
    if exe == "make":
        return f"make {argv[1]}"
    if exe in ("python", "python3") and argv[1] == "-m":
        return f"python {argv[2]}"
    if exe in ("python", "python3") and argv[1].endswith(".py"):
        return f"python {argv[1]}"
    if exe == "torchrun":
        return f"torchrun {argv[argv.index('-m') + 1]}"
    if exe == "hf":
        return f"hf {argv[1]}"
    return exe


def override(argv: list[str], key: str) -> str | None:
    for a in argv:
        if a.startswith(key + "="):
            return a.split("=", 1)[1]
    return None


def with_overrides(argv: list[str], values: dict[str, str]) -> list[str]:
    out = [a for a in argv if a.split("=", 1)[0] not in values]
    return out + [f"{k}={v}" for k, v in values.items()]


def shape_folder(root: Path, name: str) -> Path:
    """A config.json (and a tiny tokenizer) with the published shape of the Qwen2.5 size (or Qwen3 mixture, e.g.
    30B-A3B) `name` names; the planner reads config.json only."""
    size = re.search(r"(\d+(?:\.\d+)?B(?:-A\d+B)?)", name)
    assert size and size.group(1) in {**qwen_shapes.SHAPES, **qwen_shapes.MOE_SHAPES}, \
        f"README names model {name!r}: add its published shape to benchmarks/qwen_shapes.py"
    out = root / "shapes" / size.group(1)
    if not (out / "config.json").exists():
        cfg, tok = qwen_shapes.config(size.group(1))
        cfg.save_pretrained(out)
        tok.save_pretrained(out)
    return out


def write_gsm8k(folder: Path, rows: int) -> Path:
    """A parquet with GSM8K's columns (question, answer ending in '#### n')."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"question": [f"Tom has {i} apples and buys {i + 3} more. How many now?" for i in range(rows)],
                      "answer": [f"{i} + {i + 3} = {2 * i + 3}\n#### {2 * i + 3}" for i in range(rows)]})
    folder.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder)
    return folder


def failure(text: str) -> str:
    """The ranks' own error lines (the first ones say what went wrong), then the output's end."""
    errors = [x for x in text.splitlines() if re.search(r"Error|error:|Traceback", x) and "errors.html" not in x]
    return "\n".join(errors[:20] + ["..."] + text.splitlines()[-40:])


def run(argv: list[str], cwd: Path, timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def executable(argv: list[str]) -> list[str]:
    """The README's `.venv/bin/python`, `python` and `torchrun` are this interpreter (the venv under test)."""
    exe = Path(argv[0]).name
    if exe in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    if exe == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    if exe == "hf":
        return [str(Path(sys.executable).parent / "hf"), *argv[1:]]
    return argv


class User:
    """Runs README commands in one working folder, in order, as a user's shell would."""

    def __init__(self, cwd: Path, tiny_model: str):
        self.cwd, self.tiny_model = cwd, tiny_model
        self.trained: list[Path] = []

    def __call__(self, line: str) -> str:
        env, argv = split_env(shlex.split(line))
        what = program(argv)
        if what in COVERED_ELSEWHERE or argv[0] in COVERED_ELSEWHERE:
            return f"covered elsewhere: {COVERED_ELSEWHERE.get(what) or COVERED_ELSEWHERE[argv[0]]}"
        handler = {"hf download": self.hf_download, "python hybrid_rl.data.gsm8k": self.gsm8k,
                   "python hybrid_rl.demo.arithmetic": self.arithmetic,
                   "python hybrid_rl.plan": self.plan, "torchrun hybrid_rl.train": self.train,
                   "python hybrid_rl.pod": self.check_config, "python hybrid_rl.train": self.help}.get(what)
        assert handler is not None, f"the README shows a command this test does not know: {line}"
        if flag(argv, "--nnodes"):
            return self.nodes(env, argv)
        return handler(argv)

    def hf_download(self, argv: list[str]) -> str:
        # Offline: the arguments must parse (a usage error exits 2) and only the network may be missing.
        r = run(executable(argv), self.cwd, 120, env={"HF_HUB_OFFLINE": "1"})
        assert r.returncode == 1 and "offline mode is enabled" in r.stderr + r.stdout, r.stdout + r.stderr
        repo = argv[2]
        if "--repo-type" in argv and argv[argv.index("--repo-type") + 1] == "dataset":
            assert repo == "openai/gsm8k", repo  # the next commands read GSM8K's files
            local = self.cwd / argv[argv.index("--local-dir") + 1]
            write_gsm8k(local / "main/train-00000-of-00001.parquet", 24)
            write_gsm8k(local / "main/test-00000-of-00001.parquet", 6)
        return "arguments accepted (offline)"

    def gsm8k(self, argv: list[str]) -> str:
        r = run(executable(argv), self.cwd, 120)
        assert r.returncode == 0, r.stdout + r.stderr
        rows = [json.loads(x) for x in (self.cwd / argv[-1]).read_text().splitlines()]
        assert rows and all(row["ground_truth"].isdigit() for row in rows)
        return r.stdout.strip()

    def arithmetic(self, argv: list[str]) -> str:
        r = run(executable(argv), self.cwd, 120)
        assert r.returncode == 0, r.stdout + r.stderr
        rows = [json.loads(x) for x in (self.cwd / argv[-1] / "train.jsonl").read_text().splitlines()]
        assert rows and all(row["prompt"][0]["role"] == "user" for row in rows)
        return r.stdout.strip()

    def help(self, argv: list[str]) -> str:
        r = run(executable(argv), self.cwd, 120)
        assert r.returncode == 0 and "sidecar" in r.stdout, r.stdout + r.stderr
        return r.stdout.splitlines()[0]

    def model_for_plan(self, argv: list[str]) -> list[str]:
        return with_overrides(argv, {"model.path": str(shape_folder(self.cwd, override(argv, "model.path")))})

    def plan(self, argv: list[str]) -> str:
        r = run(executable(self.model_for_plan(argv)), self.cwd, 300)
        assert r.returncode == 0, f"the planner says the README's command does not fit (or fails):\n{r.stdout}{r.stderr}"
        assert "FITS" in r.stdout
        return [x for x in r.stdout.splitlines() if "FITS" in x][-1]

    def check_config(self, argv: list[str], world: int | None = None) -> str:
        """Commands of other deployments (tests/sidecar runs them with their own settings): their recipe and
        keys must be accepted as written, checked by the planner, which loads and validates the config. The
        planner's `main` runs in this process, in the user's folder: a process of its own would spend its time on
        imports."""
        from hybrid_rl.plan import main as plan

        args = argv[argv.index("-m") + 2:]
        tiny = {"model.path": self.tiny_model}
        world = world or 8
        out = io.StringIO()
        with contextlib.chdir(self.cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = plan([*with_overrides(args, tiny), "--world", str(world), "--device", "cuda", "--device-gib", "80"])
        assert code in (0, 1), f"the README's command has a bad key or value:\n{out.getvalue()}"
        return "config accepted"

    def nodes(self, env: dict[str, str], argv: list[str]) -> str:
        """A multi-node command as 2 "nodes" of 1 rank on this machine: c10d rendezvous on loopback, each node its
        own output folder (node-local disks) and address; trained, then launched again to resume."""
        assert env.get("GLOO_SOCKET_IFNAME"), "the multi-node command should show GLOO_SOCKET_IFNAME"
        env = {k: "lo" if k.endswith("_SOCKET_IFNAME") else v for k, v in env.items()}
        m = argv.index("-m")
        keep = [a for a in argv[1:m] if not a.startswith(("--nnodes", "--nproc_per_node", "--rdzv-endpoint",
                                                          "--rdzv-id", "--local-addr"))]
        assert flag(argv, "--rdzv-backend") == "c10d" and flag(argv, "--rdzv-endpoint"), argv
        out = self.cwd / "nodes"
        logs = []
        for total in (2, 3):
            port = free_port()
            procs = []
            for node in (0, 1):
                # One rank per "node": vLLM's TP groups stay inside a node, as the README asks.
                values = {**REPLACE, "trainer.total_steps": str(total), "model.path": self.tiny_model,
                          "rollout.tp": "1", "trainer.output_dir": str(out / f"node{node}")}
                cmd = [sys.executable, "-m", "torch.distributed.run", *keep, "--nnodes=2", "--nproc_per_node=1",
                       f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=readme-{total}",
                       f"--local-addr=127.0.0.{node + 1}",  # the nodes' order (and so their ranks) stays put
                       f"--rdzv-conf=is_host={int(node == 0)}", *with_overrides(argv[m:], values), *SMALL]
                env_all = dict(os.environ, PYTHONUNBUFFERED="1", **env)
                env_all["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env_all.get("PYTHONPATH")]))
                procs.append(subprocess.Popen(cmd, cwd=self.cwd, env=env_all, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
            try:
                outs = [p.communicate(timeout=900)[0] for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            for node, (p, text) in enumerate(zip(procs, outs, strict=True)):
                assert p.returncode == 0, f"node {node} of the multi-node command failed ({total} steps):\n{failure(text)}"
            logs.append(outs)
        for node in (0, 1):
            ckpt = out / f"node{node}" / "checkpoints"
            manifest = json.loads((ckpt / "step_3/COMPLETE").read_text())
            assert manifest["ranks"] == [node] and manifest["world"] == 2, manifest
            assert (ckpt / f"step_3/rank{node}.pt").is_file() and not (ckpt / f"step_3/rank{1 - node}.pt").exists()
        assert "resumed from the checkpoint of step 2" in logs[1][0], logs[1][0][-3000:]
        steps = [json.loads(x)["step"] for x in (out / "node0/metrics.jsonl").read_text().splitlines()]
        assert steps[-1] == 3 and steps.count(3) == 1, steps
        return "2 nodes trained 2 steps, then resumed from their node-local checkpoints and trained step 3"

    def train(self, argv: list[str]) -> str:
        nproc = int(next(a.split("=")[1] for a in argv if a.startswith("--nproc_per_node=")))
        # Sidecar mode (tests/sidecar), tools (tests/e2e/test_tools.py) and the SmolLM2 recipe run for real elsewhere.
        if override(argv, "rollout.mode") == "sidecar" or override(argv, "rollout.tools") or \
                flag(argv, "--config-name") in RECIPES_RUN_ELSEWHERE:
            return self.check_config(argv, world=nproc)
        out = self.cwd / f"run{len(self.trained)}"
        launcher = [a for a in argv[:argv.index("-m")] if not a.startswith("--nproc_per_node")]
        # --standalone: a free rendezvous port (other test runs may share this machine).
        cmd = [*launcher, f"--nproc_per_node={min(nproc, CPU_WORLD)}", "--standalone", *argv[argv.index("-m"):]]
        values = {**REPLACE, "model.path": self.tiny_model, "trainer.output_dir": str(out)}
        cmd = with_overrides(cmd, values) + SMALL
        r = run(executable(cmd), self.cwd, 900)
        assert r.returncode == 0, f"the README's training command failed:\n{shlex.join(cmd)}\n{failure(r.stdout + r.stderr)}"
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        if override(argv, "data.val_files"):
            assert any("val/reward_mean" in m for m in metrics), "no validation ran"
        assert (out / "checkpoints/step_2/COMPLETE").is_file() and (out / "export/config.json").is_file()
        from hybrid_rl.config import load_config, to_dict  # the run's resolved config composes back to itself

        again = to_dict(load_config(str(out / "config.yaml"), []))
        assert again["trainer"]["output_dir"] == str(out) and again["model"]["path"] == self.tiny_model
        self.trained.append(out)
        return f"trained {len(metrics)} steps"


def test_every_readme_command_is_known():
    commands = readme_commands()
    assert any(program(shlex.split(c)) == "torchrun hybrid_rl.train" for c in commands)
    known = {"hf download", "python hybrid_rl.data.gsm8k", "python hybrid_rl.plan", "torchrun hybrid_rl.train",
             "python hybrid_rl.pod", "python hybrid_rl.demo.arithmetic", "python hybrid_rl.train", *COVERED_ELSEWHERE}
    for c in commands:
        argv = split_env(shlex.split(c))[1]
        assert program(argv) in known or argv[0] in known, f"README command with no test: {c}"
    assert any("--nnodes" in c for c in commands), "the README shows no multi-node command"
    assert not any("huggingface-cli" in c for c in commands), "the lock ships `hf`, not huggingface-cli"


@VLLM_TP2  # the GPU recipe at rollout.tp=2
def test_readme_commands_run(tiny_models, tmp_path):
    """Every README command, in the README's order, in one folder (the GPU recipe's commands feed each other)."""
    user = User(tmp_path, tiny_models["qwen2"])
    done = [(c, user(c)) for c in readme_commands()]
    print("\n".join(f"{what}\n    -> {c}" for c, what in done))
    assert user.trained, "no training command ran"
