"""A checkpoint copied from elsewhere is data, never code: files whose pickles would call a function are refused.

The payloads below make a directory when they run (`os.mkdir` via `__reduce__`), so a test sees whether one ran.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from hybrid_rl.checkpoint import Checkpointer, CheckpointError
from hybrid_rl.checkpoint.layout import COMPLETE, SHARED, read_manifest


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _saved(tmp_path: Path) -> tuple[Checkpointer, Path]:
    model, optimizer = _model()
    ck = Checkpointer(tmp_path / "ckpt", keep_last=2, rank=0, world=1)
    path = ck.save(1, components={"policy": (model, optimizer)}, rank_state={"rng": torch.get_rng_state()},
                   shared_state={"step": 1, "config": {"model": "m", "lr": 1e-2, "betas": (0.9, 0.95)}})
    return ck, path


def _replace(path: Path, rel: str, data: bytes) -> None:
    """Swap a file of a committed checkpoint and fix its manifest, as whoever crafts a checkpoint would."""
    (path / rel).write_bytes(data)
    manifest = json.loads((path / COMPLETE).read_text())
    manifest["files"][rel] = len(data)
    (path / COMPLETE).write_text(json.dumps(manifest))
    assert read_manifest(path).files[rel] == len(data)


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_a_normal_checkpoint_still_resumes(tmp_path):
    ck, _ = _saved(tmp_path)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    step, rank_state, shared = ck.resume_auto({"policy": (fresh, fresh_opt)})
    assert step == 1 and shared["config"]["betas"] == (0.9, 0.95)
    assert rank_state["rng"].dtype == torch.uint8 and rank_state["rng"].numel() > 0
    assert torch.equal(fresh[0].weight, _model()[0][0].weight)


@pytest.mark.parametrize("rel", [SHARED, "rank0.pt"])
def test_a_pickled_payload_in_the_state_files_is_refused_and_does_not_run(tmp_path, rel):
    ck, path = _saved(tmp_path)
    marker = tmp_path / "payload_ran"
    _replace(path, rel, _torch_bytes({"step": 1, "x": _Payload(marker)}))
    model, optimizer = _model()
    with pytest.raises(CheckpointError, match=rf"{rel}.*refused") as caught:
        ck.resume_auto({"policy": (model, optimizer)})
    assert "os.mkdir" in str(caught.value) or "posix.mkdir" in str(caught.value)
    assert not marker.exists(), "the checkpoint's payload ran"


def test_a_pickled_payload_in_dcp_metadata_is_refused_and_does_not_run(tmp_path):
    ck, path = _saved(tmp_path)
    marker = tmp_path / "payload_ran"
    _replace(path, "policy/rank0/.metadata", pickle.dumps(_Payload(marker)))
    model, optimizer = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=r"policy/rank0/\.metadata.*refused"):
        ck.resume_auto({"policy": (model, optimizer)})
    assert not marker.exists(), "the checkpoint's payload ran"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_refused_file_is_not_skipped_for_an_older_checkpoint(tmp_path):
    """Falling back to an older step would hide that someone planted a file in the output folder."""
    ck, _ = _saved(tmp_path)
    model, optimizer = _model()
    newer = ck.save(2, components={"policy": (model, optimizer)}, rank_state={}, shared_state={"step": 2})
    _replace(newer, SHARED, _torch_bytes(_Payload(tmp_path / "payload_ran")))
    with pytest.raises(CheckpointError, match="refused"):
        ck.resume_auto({"policy": (model, optimizer)})
    assert not (tmp_path / "payload_ran").exists()


def test_the_experience_buffers_samples_and_records_load_as_data(tmp_path):
    """What a buffered (sidecar) run saves: its finished samples and the records of its live groups."""
    from hybrid_rl.data.records import PromptRecord, ReadOnlyFields
    from hybrid_rl.types import Sample

    record = PromptRecord(3, "q", (1, 2), ReadOnlyFields({"ground_truth": "4", "tests": [{"input": "1"}]}))
    sample = Sample(7, torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([-0.5]), False, 0, 3, record.fields)
    model, optimizer = _model()
    ck = Checkpointer(tmp_path / "ckpt", keep_last=1, rank=0, world=1)
    ck.save(1, components={"policy": (model, optimizer)}, rank_state={"source": {"held": [sample]}},
            shared_state={"source": {"kind": "buffered", "book": {"live": [(0, record, 1, 0, 0, 0)]}}})
    _, rank_state, shared = ck.resume_auto({"policy": (model, optimizer)})
    held = rank_state["source"]["held"][0]
    assert held.uid == 7 and torch.equal(held.response_ids, sample.response_ids) and dict(held.fields) == {
        "ground_truth": "4", "tests": [{"input": "1"}]}
    assert shared["source"]["book"]["live"][0][1] == record
