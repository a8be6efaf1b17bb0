"""Storage-level offload: every target round-trips bitwise, frees the storages it moves, and brackets a model.

On this CPU-only machine the `cpu` target copies into separate (unpinned) host buffers: the same
code as from an accelerator, so these tests run it.
"""

import pytest
import torch

from hybrid_rl.dist.offload import OffloadManager, optimizer_tensors, param_tensors


def _tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(64, 33)
    return [base, base[3:9], torch.randn(17).to(torch.bfloat16), torch.arange(10)]  # a view shares base's storage


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_round_trip_is_bitwise_and_frees_every_storage(tmp_path, target):
    tensors = _tensors()
    before = [t.clone() for t in tensors]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    m = OffloadManager(tmp_path, rank=3)
    freed = m.offload("c", tensors, target)
    assert freed == sum(storages.values())  # the shared storage counted once
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)  # nothing left behind in the tensors
    assert m.offloaded_bytes() == {"c": freed} and m.is_offloaded("c")
    assert (tmp_path / "c.rank3.bin").exists() == (target == "disk")
    m.reload("c")
    assert all(torch.equal(t, b) and t.dtype == b.dtype for t, b in zip(tensors, before, strict=True))
    assert tensors[1].untyped_storage().data_ptr() == tensors[0].untyped_storage().data_ptr()  # still a view
    assert not m.is_offloaded("c") and not (tmp_path / "c.rank3.bin").exists()
    m.offload("c", tensors, target)  # a component goes out and comes back again and again
    m.reload("c")
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
    assert m.moved_bytes == {"c": 2 * freed}


def test_none_moves_nothing_and_bad_targets_are_named(tmp_path):
    tensors = _tensors()
    m = OffloadManager(tmp_path)
    assert m.offload("c", tensors, "none") == 0
    assert all(t.untyped_storage().nbytes() > 0 for t in tensors) and not m.is_offloaded("c")
    assert m.moved_bytes == {}
    with pytest.raises(ValueError, match="'gpu'"):
        m.offload("c", tensors, "gpu")


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_resident_brackets_a_pass_and_an_update_as_the_trainer_does(tmp_path, target):
    """The critic's life: a value pass (params only), then its update (params and AdamW state), offloaded
    between; training is bitwise the same as with everything resident."""
    model, opt = _model()
    ref, ref_opt = _model()
    m = OffloadManager(tmp_path)
    for step in range(3):
        with m.resident("critic", target, model):  # the value pass needs no optimizer state
            assert all(t.untyped_storage().nbytes() > 0 for t in param_tensors(model))
            if step:
                assert m.is_offloaded("critic.optim")
        assert not any(t.untyped_storage().nbytes() for t in param_tensors(model))
        with m.resident("critic", target, model, opt):
            _train_step(model, opt, step)
        _train_step(ref, ref_opt, step)
        moments = optimizer_tensors(opt)
        assert len(moments) == 2 * len(param_tensors(model))  # AdamW's two per parameter (a 1-element bias too)
        assert not any(t.untyped_storage().nbytes() for t in param_tensors(model) + moments)
    with m.resident("critic", target, model, opt):  # e.g. to be saved
        got = param_tensors(model) + optimizer_tensors(opt)
        want = param_tensors(ref) + optimizer_tensors(ref_opt)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_an_error_in_the_body_leaves_the_model_resident(tmp_path):
    model, opt = _model()
    m = OffloadManager(tmp_path)
    with m.resident("critic", "disk", model, opt):
        _train_step(model, opt, 0)
    with pytest.raises(RuntimeError, match="boom"), m.resident("critic", "disk", model, opt):
        raise RuntimeError("boom")
    assert not m.is_offloaded("critic") and not m.is_offloaded("critic.optim")
    assert all(t.untyped_storage().nbytes() > 0 for t in param_tensors(model) + optimizer_tensors(opt))


def test_close_deletes_the_files_of_components_still_on_disk(tmp_path):
    m = OffloadManager(tmp_path)
    m.offload("reference", _tensors(), "disk")
    assert (tmp_path / "reference.rank0.bin").stat().st_size > 0
    m.close()
    assert not list(tmp_path.iterdir()) and m.offloaded_bytes() == {}
