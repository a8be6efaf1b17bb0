"""One run per output folder (a real `flock` held by another process), and a resume refuses another run's checkpoint."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from hybrid_rl.checkpoint import Checkpointer
from hybrid_rl.checkpoint.compat import IncompatibleCheckpoint, check_resume
from hybrid_rl.checkpoint.run_lock import RUN_LOCK, RunLocked, hold_run_lock, node_lock

_HOLDER = textwrap.dedent("""
    import sys, time
    from hybrid_rl.checkpoint.run_lock import hold_run_lock
    with hold_run_lock(sys.argv[1], rank=int(sys.argv[2]), local_rank=int(sys.argv[3])):
        print("held", flush=True)
        time.sleep(120)
""")


@pytest.fixture
def other_run(tmp_path):
    """Another process holding the folder, as another run's rank would; stopped after the test."""
    procs = []

    def start(rank: int = 0, local_rank: int = 0) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "out"), str(rank), str(local_rank)],
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "held"
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_second_run_in_the_folder_is_refused_naming_the_holder(tmp_path, other_run):
    holder = other_run()
    with pytest.raises(RunLocked, match=rf"in use by another run \(host {socket.gethostname()}, pid {holder.pid},"):
        with hold_run_lock(tmp_path / "out", rank=0, local_rank=0):
            pass


def test_another_rank_on_the_node_of_a_run_is_refused_by_the_node_lock(tmp_path, other_run):
    """On a shared filesystem a second run whose rank 0 is elsewhere still meets this node's lock."""
    other_run(rank=1, local_rank=0)  # holds only run.<host>.lock
    with pytest.raises(RunLocked, match=rf"{node_lock()}|in use"):
        with hold_run_lock(tmp_path / "out", rank=3, local_rank=0):
            pass
    with hold_run_lock(tmp_path / "out", rank=0, local_rank=1):  # the global lock itself is free
        pass


def test_the_lock_is_released_when_its_holder_is_killed(tmp_path, other_run):
    holder = other_run()
    holder.kill()
    holder.wait()
    with hold_run_lock(tmp_path / "out", rank=0, local_rank=0):
        assert (tmp_path / "out" / RUN_LOCK).stat().st_mode & 0o777 == 0o600
        assert f"pid={os.getpid()}" in (tmp_path / "out" / RUN_LOCK).read_text()


def test_ranks_other_than_the_first_take_no_lock(tmp_path, other_run):
    other_run()
    with hold_run_lock(tmp_path / "out", rank=1, local_rank=1):
        pass


def _net(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


CONFIG = {"model": {"path": "/models/Qwen2.5-0.5B", "lora": {"rank": 0}},
          "algorithm": {"name": "grpo", "advantage": "grpo", "objective": "ppo_clip"},
          "optim": {"name": "adamw", "lr": 1e-6},
          "trainer": {"total_steps": 10, "save_every": 5, "output_dir": "/runs/a"}}


def _saved(tmp_path, width: int = 8) -> Checkpointer:
    model, opt = _net(width)
    ck = Checkpointer(tmp_path / "ckpt", keep_last=2, rank=0, world=1)
    ck.save(1, components={"policy": (model, opt)}, rank_state={}, shared_state={"config": CONFIG})
    return ck


def test_a_model_of_other_shapes_is_refused_as_such_and_left_untouched(tmp_path):
    ck = _saved(tmp_path)
    model, opt = _net(16)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(IncompatibleCheckpoint, match=r"another model .*0\.weight was saved as \[8, 4\], this "
                                                     r"model's is \[16, 4\]") as caught:
        ck.resume_auto({"policy": (model, opt)})
    assert "damaged" not in str(caught.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _with(**changes) -> dict:
    cfg = {k: dict(v) for k, v in CONFIG.items()}
    for key, value in changes.items():
        section, name = key.split("__")
        cfg[section][name] = value
    return cfg


@pytest.mark.parametrize("changes", [{"algorithm__advantage": "rloo"}, {"algorithm__objective": "dpo"},
                                     {"model__path": "/models/Llama-3.2-1B"}, {"optim__name": "adamw8bit"}])
def test_another_model_or_algorithm_is_refused_before_loading(tmp_path, changes):
    _saved(tmp_path)
    key = next(iter(changes)).replace("__", ".")
    with pytest.raises(IncompatibleCheckpoint, match=rf"another model or algorithm \({key}: "):
        check_resume(tmp_path / "ckpt", _with(**changes), rank=0)


def test_keys_a_relaunch_may_change_pass_and_others_are_listed(tmp_path):
    _saved(tmp_path)
    moved = _with(trainer__total_steps=50, trainer__save_every=1, trainer__output_dir="/elsewhere",
                  model__path="/scratch/copy/Qwen2.5-0.5B/")
    assert check_resume(tmp_path / "ckpt", moved, rank=0) == []
    assert check_resume(tmp_path / "ckpt", _with(optim__lr=2e-6), rank=0) == ["optim.lr: 1e-06 -> 2e-06"]
    assert check_resume(tmp_path / "nothing", _with(algorithm__name="ppo"), rank=0) == []
