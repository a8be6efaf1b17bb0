"""Adapter version labels from the pod group name folders: only the run's own labels, only directly under the root
(a label `../../x` once wrote, then deleted, a folder outside it)."""

import pytest

from hybrid_rl.sidecar.server_adapter import ADAPTER_FILES, AdapterFolders
from hybrid_rl.weightsync.reshard import WeightSyncError

FILES = {name: b"x" for name in ADAPTER_FILES}


def test_a_label_that_climbs_out_of_the_root_is_refused_and_nothing_outside_is_touched(tmp_path):
    outside = tmp_path / "x"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    root = tmp_path / "a" / "b"
    folders = AdapterFolders(root, keep=1, labels=r"run7-v\d+")
    for label in ("../../x", "..", "/tmp/x", "run7-v1/../../../x", "run8-v1", "run7-v1x", ""):
        with pytest.raises(WeightSyncError, match="refused"):
            folders.write_files(label, FILES)
    folders.versions = ["../../x"]  # even a label that got in some other way is never deleted outside the root
    with pytest.raises(WeightSyncError, match="refused"):
        folders.add("run7-v2")
    assert (outside / "keep").read_text() == "mine"
    assert not root.exists() or not any(root.iterdir())


def test_the_runs_own_labels_are_written_and_rotated_under_the_root(tmp_path):
    folders = AdapterFolders(tmp_path / "r", keep=2, labels=r"run7-v\d+")
    for v in range(1, 4):
        folders.write_files(f"run7-v{v}", FILES)
        folders.add(f"run7-v{v}")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["run7-v2", "run7-v3"]
