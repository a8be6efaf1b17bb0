"""Storage-level offload: every target round-trips bitwise, frees the storages it moves, and brackets a model.

On this CPU-only machine the `cpu` target copies into one flat (unpinned) host buffer per component: the
same code as from an accelerator, so these tests run it; the pinned branch runs here with the two CUDA calls
(`_pin`: cudaHostRegister, and the stream synchronisation) recorded instead of made.
"""

import pytest
import torch

from hybrid_rl.distributed import offload as offload_mod
from hybrid_rl.distributed.offload import (
    HOST_ALIGN,
    OffloadManager,
    flat_layout,
    optimizer_tensors,
    param_tensors,
    power_of_two_bytes,
)


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


def test_cpu_target_packs_a_component_into_one_flat_aligned_buffer(tmp_path):
    tensors = _tensors()
    before = [t.clone() for t in tensors]
    m = OffloadManager(tmp_path)
    m.offload("c", tensors, "cpu")
    stashes = m._components["c"].stashes
    flat = {s.cpu.untyped_storage().data_ptr() for s in stashes}
    assert len(flat) == 1  # one host allocation for the whole component
    assert all(s.offset % HOST_ALIGN == 0 for s in stashes)
    offsets, total = flat_layout(s.nbytes for s in stashes)
    assert [s.offset for s in stashes] == offsets and stashes[0].cpu.untyped_storage().nbytes() == total
    assert m.host_bytes() == total
    m.reload("c")
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
    assert m.host_bytes() == 0  # unpinned buffers go with the reload


def test_flat_layout_costs_what_is_offloaded_where_per_tensor_pinned_blocks_cost_up_to_twice():
    offsets, total = flat_layout([3, 1000, 512, 1])
    assert offsets == [0, 512, 1536, 2048] and total == 2049
    # A 7B Qwen2 block's fp32 shards on 8 ranks (q, k, v, o, gate, up, down, and the biases and norms).
    h, i, kv = 3584, 18944, 512
    sizes = [4 * n // 8 for n in (h * h, h, kv * h, kv, kv * h, kv, h * h, i * h, i * h, h * i, h, h)]
    _, flat = flat_layout(sizes)
    assert flat <= sum(sizes) + HOST_ALIGN * len(sizes)
    assert power_of_two_bytes(sizes) > 1.3 * flat  # what the caching host allocator's rounding held


def test_pinned_buffer_is_registered_once_reused_across_offloads_and_unpinned_at_close(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(offload_mod, "_pin", lambda t: calls.append(("pin", t.data_ptr(), t.numel())))
    monkeypatch.setattr(offload_mod, "_unpin", lambda t: calls.append(("unpin", t.data_ptr(), t.numel())))
    monkeypatch.setattr(offload_mod, "_on_accelerator", lambda tensors: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    tensors = _tensors()
    before = [t.clone() for t in tensors]
    m = OffloadManager(tmp_path)
    ptrs = []
    for _ in range(3):  # every rollout: out and back, into the same registered buffer
        m.offload("actor.optim", tensors, "cpu")
        ptrs.append(m._components["actor.optim"].stashes[0].cpu.untyped_storage().data_ptr())
        m.reload("actor.optim")
        assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
    _, total = flat_layout(sorted({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                   for t in tensors}.values(), key=lambda n: -n))
    assert len(set(ptrs)) == 1 and [c[0] for c in calls] == ["pin"] and calls[0][2] == m.host_bytes()
    assert m.host_bytes() >= total - HOST_ALIGN  # the component's size, exactly (plus alignment), kept for the run
    m.close()
    assert [c[0] for c in calls] == ["pin", "unpin"] and calls[1][1] == calls[0][1] and m.host_bytes() == 0
