"""The test launcher's one rerun: only for a launch that failed with a native abort's message, and only once."""

import sys

import pytest

from tests.conftest import NATIVE_ABORT, run_once_more_on_native_abort

# Fails with `message` on stderr while the counter file holds fewer than `failures` lines; appends a line each run.
SCRIPT = """
import sys
path, failures, message = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(path, "a+") as f:
    f.seek(0)
    runs = len(f.read().splitlines())
    f.write("run\\n")
if runs < failures:
    sys.stderr.write(message + "\\n")
    sys.exit(134)
"""


def _launch(tmp_path, failures: int, message: str):
    tmp_path.mkdir(exist_ok=True)
    counter = tmp_path / "runs"
    proc = run_once_more_on_native_abort([sys.executable, "-c", SCRIPT, str(counter), str(failures), message], "probe")
    return proc.returncode, len(counter.read_text().splitlines())


def test_a_native_abort_is_run_once_more_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="probe: a process aborted"):
        assert _launch(tmp_path, 1, NATIVE_ABORT) == (0, 2)


def test_a_second_native_abort_fails_and_other_failures_are_not_rerun(tmp_path):
    with pytest.warns(UserWarning):
        assert _launch(tmp_path / "a", 2, NATIVE_ABORT) == (134, 2)
    assert _launch(tmp_path / "b", 1, "Traceback (most recent call last): ValueError") == (134, 1)
