"""The code sandbox is there, or the install and the tests say so: nothing skips silently.

``scripts/install_sandbox.sh`` (run by ``make install-sandbox``, which ``make test`` runs) is run for real, once on this machine's PATH
and otherwise on a PATH holding only stand-ins for ``id``, ``apt-get``, ``sudo`` and ``bwrap``: they
play the machines it must handle (not root, apt-get failing, bubblewrap that cannot create namespaces)
and write down how they were called. The sandbox probe the script ends with is the real one.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "install_sandbox.sh"
ROOT, USER = "echo 0", "echo 1000"
APT_FAILS = 'echo "E: Unable to locate package bubblewrap"; exit 100'
BWRAP_FORBIDDEN = 'echo "bwrap: setting up uid map: Permission denied" >&2; exit 1'


def _install(tmp_path: Path, *mode: str, **tools: str) -> subprocess.CompletedProcess[str]:
    """Run the script with PATH = a folder holding only ``tools`` (name -> sh body); $LOG, $BIN usable there."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    log.touch()
    for name, body in tools.items():
        stand_in = bin_dir / name.replace("_", "-")
        stand_in.write_text(f'#!/bin/sh\nLOG={log}\nBIN={bin_dir}\necho "{name} $*" >> "$LOG"\n{body}\n')
        stand_in.chmod(0o755)
    env = {"PATH": str(bin_dir), "PYTHONPATH": str(REPO)}
    bash = shutil.which("bash") or "/bin/bash"
    return subprocess.run([bash, str(SCRIPT), sys.executable, *mode], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def _calls(tmp_path: Path) -> str:
    return (tmp_path / "calls.log").read_text()


def _apt_installs() -> str:
    """apt-get that 'installs' bubblewrap: links this machine's bwrap into the PATH folder."""
    real = shutil.which("bwrap")
    assert real, "bubblewrap (bwrap) is not installed on this machine; CI must have it (make test installs it: make install-sandbox)"
    return f'[ "$1" = install ] && {shutil.which("ln")} -s {real} "$BIN/bwrap"; exit 0'


def test_install_finds_the_sandbox_working_on_this_machine():
    env = {"PATH": os.environ.get("PATH", os.defpath), "PYTHONPATH": str(REPO)}
    result = subprocess.run(["bash", str(SCRIPT), sys.executable], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "code sandbox: isolation level 'bwrap' works here" in result.stdout


def test_user_without_root_or_sudo_is_told_what_to_do_and_the_install_stops(tmp_path):
    result = _install(tmp_path, id=USER, apt_get="exit 1")
    assert result.returncode == 1
    assert "bubblewrap (bwrap) is not installed, and this user can install it neither as root nor" in result.stderr
    assert "Ask an administrator to install the package 'bubblewrap'" in result.stderr
    assert "make install-sandbox SANDBOX=optional" in result.stderr
    assert "apt_get" not in _calls(tmp_path)


def test_optional_sandbox_lets_the_install_go_on_with_a_warning(tmp_path):
    result = _install(tmp_path, "optional", id=USER)
    assert result.returncode == 0
    assert result.stderr.startswith("WARNING: code sandbox: bubblewrap (bwrap) is not installed")
    assert "refuses untrusted code unless built with min_isolation='rlimits'" in result.stderr


def test_unknown_sandbox_mode_is_an_error(tmp_path):
    result = _install(tmp_path, "maybe", id=ROOT)
    assert result.returncode == 2 and "SANDBOX=maybe: choose required or optional" in result.stderr


def test_root_whose_apt_get_fails_gets_an_error_with_apt_gets_output(tmp_path):
    result = _install(tmp_path, id=ROOT, apt_get=APT_FAILS)
    assert result.returncode == 1
    assert "E: Unable to locate package bubblewrap" in result.stderr
    assert "apt-get failed to install it" in result.stderr
    assert re.findall(r"apt_get (\w+)", _calls(tmp_path)) == ["install", "update"]  # then retried after an update


def test_root_without_apt_get_is_told_to_use_its_package_manager(tmp_path):
    result = _install(tmp_path, id=ROOT)
    assert result.returncode == 1 and "installs it with apt-get only" in result.stderr


def test_root_installs_bubblewrap_and_the_sandbox_probe_checks_it(tmp_path):
    result = _install(tmp_path, id=ROOT, apt_get=_apt_installs())
    assert result.returncode == 0, result.stderr
    assert "apt_get install -y -q bubblewrap" in _calls(tmp_path)
    assert "isolation level 'bwrap' works here" in result.stdout


def test_user_with_passwordless_sudo_installs_through_sudo(tmp_path):
    sudo = '[ "$1" = -n ] && shift; "$@"'
    result = _install(tmp_path, id=USER, sudo=sudo, apt_get=_apt_installs())
    assert result.returncode == 0, result.stderr
    assert "sudo -n apt-get install -y -q bubblewrap" in _calls(tmp_path)


def test_bubblewrap_that_cannot_create_namespaces_stops_the_install(tmp_path):
    result = _install(tmp_path, id=USER, bwrap=BWRAP_FORBIDDEN)
    assert result.returncode == 1
    assert "bubblewrap is installed but does not work here" in result.stderr
    assert "bwrap: setting up uid map: Permission denied" in result.stderr  # the probe's reason
    assert "unprivileged user namespaces must be allowed" in result.stderr


def test_sandbox_tests_fail_rather_than_skip_where_bubblewrap_is_missing(tmp_path):
    files = [f"tests/integration/rewards/{name}"
             for name in ("test_sandbox_attacks.py", "test_code_sandbox.py", "test_code_reward_sandbox.py")]
    env = {"PATH": str(tmp_path), "PYTHONPATH": str(REPO)}  # an empty folder: no bwrap

    def pytest_(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "pytest", *files, "-p", "no:cacheprovider", "-q", *args]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    collected = pytest_("--collect-only", "-m", "sandbox")
    sandbox_tests = {line for line in collected.stdout.splitlines() if "::" in line}
    run = pytest_("-rf", "--tb=line")
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 1 and "skipped" not in summary, run.stdout[-3000:]
    failed = {line.split()[1] for line in run.stdout.splitlines() if line.startswith("FAILED ")}
    assert len(sandbox_tests) > 30 and failed == sandbox_tests, summary
    reason = "SandboxUnavailableError: code sandbox needs isolation 'bwrap' but only 'rlimits' works here: " \
             "bubblewrap (bwrap) is not installed"  # fmt: skip
    assert sum(line.startswith("/") and reason in line for line in run.stdout.splitlines()) == len(failed)
