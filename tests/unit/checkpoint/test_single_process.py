"""A world of one (plain `python`, no process group): the same Checkpointer works without collectives."""

from __future__ import annotations

import torch

from hybrid_rl.checkpoint import Checkpointer


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_single_process_save_and_resume_round_trip(tmp_path):
    model, opt = _model_and_optimizer(0)
    _step(model, opt)
    ck = Checkpointer(tmp_path, keep_last=2, rank=0, world=1)
    ck.save(1, components={"policy": (model, opt)}, rank_state={"rng": torch.get_rng_state()},
            shared_state={"step": 1})
    fresh, fresh_opt = _model_and_optimizer(1)
    step, rank_state, shared_state = ck.resume_auto({"policy": (fresh, fresh_opt)})
    assert (step, shared_state) == (1, {"step": 1})
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], fresh_opt.state_dict()["state"][0]["exp_avg"])


def test_saving_a_step_again_replaces_it(tmp_path):
    model, _ = _model_and_optimizer(0)
    ck = Checkpointer(tmp_path, keep_last=2, rank=0, world=1)
    ck.save(1, components={"policy": (model, None)}, rank_state={}, shared_state={"version": "first"})
    ck.save(1, components={"policy": (model, None)}, rank_state={}, shared_state={"version": "second"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    assert ck.resume_auto({"policy": (model, None)})[2] == {"version": "second"}
