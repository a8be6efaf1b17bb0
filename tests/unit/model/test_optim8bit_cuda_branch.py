"""`optim.name=adamw8bit` on a GPU runs torchao's own step (`optimizers._eager_on_cpu` hands every non-CPU
parameter to it), which compiles its per-tensor update there; the CPU path replaces it. Here that step itself runs
on CPU, eagerly (`torch.compiler.set_stance("force_eager")`: torchao's Python step, its state creation and its lr
check; only the compiled kernel differs), in the life a run gives it: a warm-up scheduler as `build.py` makes it,
which writes the learning rate at every step, and a checkpoint round trip (DCP for the model and optimizer, the
scheduler's state as the checkpointer saves it) in the middle. torchao refuses a learning rate that is no longer a
tensor ("lr was changed to a non-Tensor object"): the scheduler and the resume must keep it one, and the resumed
run must continue exactly as the uninterrupted one."""

from __future__ import annotations

import io

import pytest
import torch
import torchao.optim.adam as torchao_adam

from hybrid_rl.checkpoint.state import load_component, save_component
from hybrid_rl.distributed.offload import optimizer_tensors
from hybrid_rl.model.optimizers import build_optimizer, state_to_come
from hybrid_rl.utils.schedule import lr_multiplier

SHAPES = [(64, 512), (37, 100)]  # 8-bit moments, float32 moments


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES])
    opt = build_optimizer("adamw8bit", model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    f = lr_multiplier(warmup_steps=2, total_steps=6, schedule="cosine", min_ratio=0.1)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, f)


def _cuda_branch_step(model, opt, sched, i: int) -> None:
    """One update as the trainer makes it, through the step a GPU run takes (torchao's, not the CPU chunks)."""
    g = torch.Generator().manual_seed(100 + i)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    torchaos_step = next(c for c in type(opt).__mro__ if c.__module__ == torchao_adam.__name__).step
    with torch.compiler.set_stance("force_eager"):
        torchaos_step(opt)
    sched.step()
    opt.zero_grad(set_to_none=True)
    for group in opt.param_groups:
        assert isinstance(group["lr"], torch.Tensor), "torchao's next step would refuse this learning rate"


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")  # torchao's step called unbound
def test_torchaos_step_survives_the_scheduler_and_a_checkpoint_round_trip(tmp_path):
    straight = _setup()
    for i in range(4):
        _cuda_branch_step(*straight, i)

    model, opt, sched = _setup()
    for i in range(2):
        _cuda_branch_step(model, opt, sched, i)
    assert type(opt.state[model[0]]["exp_avg"]).__name__ == "OptimState8bit"  # the 8-bit path really ran
    save_component(tmp_path, model, opt, rank=0)
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)

    model, opt, sched = _setup(seed=1)  # a fresh process: other initial weights, no optimizer state
    load_component(tmp_path, model, opt, rank=0)
    buf.seek(0)
    sched.load_state_dict(torch.load(buf, weights_only=False))
    assert all(isinstance(g["lr"], torch.Tensor) for g in opt.param_groups)
    for i in range(2, 4):
        _cuda_branch_step(model, opt, sched, i)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), straight[0].parameters(), strict=True))
    assert torch.equal(opt.param_groups[0]["lr"], straight[1].param_groups[0]["lr"])


@pytest.mark.parametrize("name", ["adamw8bit", "adamw"])
def test_the_state_to_come_is_what_the_first_step_creates(name):
    """vLLM's automatic share leaves room for the optimizer state still to come (`state_to_come`): 8-bit moments
    at their size (codes, block scales, code table), not at AdamW's 8 bytes per element."""
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in SHAPES])
    opt = build_optimizer(name, model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    before = state_to_come(opt)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert before == sum(t.nbytes for t in optimizer_tensors(opt)) and state_to_come(opt) == 0
