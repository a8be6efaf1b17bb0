"""`distributed/gloo_comms`: FSDP2's gathers and reductions as pairwise exchanges on CPU, against gloo's own.

One 3-rank torchrun launch (`workers/gloo_comms.py`; 3 so that a rank has more than one peer and the
reduce-scatter more than one round); each test checks one behaviour of its record.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_torchrun

WORKER = Path(__file__).parent / "workers" / "gloo_comms.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def record(tiny_models, tmp_path_factory) -> dict:
    return run_torchrun(WORKER, "--model", tiny_models["qwen2"], nproc=3, tmp_path=tmp_path_factory.mktemp("gloo"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_collectives_give_gloos_results(record, dtype):
    assert record["world"] == 3
    assert record[f"reduce_scatter_{dtype}"]
    assert record[f"all_gather_{dtype}"]


def test_the_reduce_scatter_refuses_an_op_it_does_not_do(record):
    assert record["avg_refused"]


def test_shard_model_installs_them_on_every_unit_on_cpu(record):
    assert record["installed"]
    assert record["installed_shm"]  # shared memory by default, the pairwise exchanges with shared_memory=False


def test_training_through_them_matches_training_through_gloos(record):
    assert record["first_logits_equal"]  # the gathered weights are bitwise gloo's
    assert record["min_param_moved"] > 0  # two steps moved every parameter...
    assert record["max_param_diff_pairwise"] < 1e-5, record  # ...the same way (summed in another order: not bitwise)
    assert record["losses"]["pairwise"] == pytest.approx(record["losses"]["gloo"], rel=1e-4)


def test_training_through_shared_memory_matches_training_through_gloos(record):
    assert record["shm_used"], "the all-gathers and reduce-scatters did not go through shared memory"
    assert record["first_logits_equal_shm"]
    assert record["max_param_diff_shm"] < 1e-5, record
    assert record["losses"]["shm"] == pytest.approx(record["losses"]["gloo"], rel=1e-4)
    assert record["shm_left"] == [], "shared-memory files left in /dev/shm while the segments are mapped"


def test_weights_whole_on_every_rank_train_as_with_gloos_own_without_the_copy(record):
    """HSDP at shard size 1: the reduce-scatter's output is its input (no copy), and training is bitwise FSDP2's."""
    assert record["installed_whole"]
    assert record["whole_outputs_aliased"] == 2, "every unit's two backwards should take the input as output"
    assert record["whole_equal"], record["whole_losses"]
