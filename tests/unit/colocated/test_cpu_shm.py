"""The shared-memory ledger on real files and real mappings (a temporary directory stands in for /dev/shm):
only what this job recorded is removed, and only when no live process maps it."""

import json
import mmap
import os

from hybrid_rl.colocated.cpu_shm import ShmLedger
from hybrid_rl.utils.shm import mapped_paths


def _segment(d, name: str) -> str:
    path = d / name
    path.write_bytes(b"\0" * 4096)
    return str(path)


def _map(path: str) -> mmap.mmap:
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), 4096)  # stays mapped after the file is closed, like vLLM's segments


def test_record_keeps_what_this_process_created_and_maps(tmp_path):
    shm, ledger_file = tmp_path / "shm", tmp_path / "run" / "vllm_shm" / "rank0.json"
    shm.mkdir()
    foreign = _segment(shm, "-tp:0-[0-1]-cpushm_0")  # another job's, there before our start
    ledger = ShmLedger(ledger_file, shm_dir=shm)
    before = ledger.segments()
    ours = [_segment(shm, "-tp:1-[0-1]-cpushm_0"), _segment(shm, "-tp:1-[0-1]-cpushm_1")]
    maps = [_map(p) for p in ours]  # this rank maps its own segment and its peer's
    unmapped_new = _segment(shm, "-tp:7-[2-3]-cpushm_0")  # appeared meanwhile, but another job's: not mapped here
    _segment(shm, "psm_other")  # not vLLM's
    assert ledger.record(before) == sorted(ours)
    assert json.loads(ledger_file.read_text()) == sorted(ours)
    note = ledger.start_failure_note(before | {ours[0]})
    assert f"not created by this job: {foreign};" in note
    assert f"still mapped by a live process: {ours[0]}." in note
    assert ledger.start_failure_note(set()) == ""
    assert unmapped_new not in ledger.recorded()
    for m in maps:
        m.close()


def test_remove_stale_unlinks_only_recorded_segments_no_process_maps(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    crashed = _segment(shm, "-tp:0-[0-1]-cpushm_0")  # ours, left by a killed run
    live = _segment(shm, "-tp:0-[0-1]-cpushm_1")  # ours, but a live process (here: this one) still maps it
    foreign = _segment(shm, "-tp:0-[2-3]-cpushm_0")  # not in our ledger, mapped by nobody: another job's
    gone = str(shm / "-tp:9-[0-1]-cpushm_0")  # recorded, already removed by a peer
    ledger_file = tmp_path / "rank0.json"
    ledger_file.write_text(json.dumps([crashed, live, gone]))
    m = _map(live)
    assert live in mapped_paths([str(os.getpid())])
    assert ShmLedger(ledger_file, shm_dir=shm).remove_stale() == [crashed]
    assert not os.path.exists(crashed) and os.path.exists(live) and os.path.exists(foreign)
    m.close()


def test_without_a_ledger_nothing_is_recorded_or_removed(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    seg = _segment(shm, "-tp:0-[0-1]-cpushm_0")
    ledger = ShmLedger(None, shm_dir=shm)
    assert ledger.remove_stale() == [] and os.path.exists(seg)
    m = _map(_segment(shm, "-tp:1-[0-1]-cpushm_0"))
    assert ledger.record(set()) == [str(shm / "-tp:1-[0-1]-cpushm_0")] and ledger.recorded() == set()
    m.close()
