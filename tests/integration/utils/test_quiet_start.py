"""A quiet start: importing the stack as the entry points do prints nothing that is not ours and actionable."""

import subprocess
import sys

from tests.conftest import REPO


def test_importing_the_stack_prints_no_foreign_noise():
    code = ("from hybrid_rl.utils.env import set_runtime_defaults; set_runtime_defaults()\n"
            "from hybrid_rl.utils.logs import setup_logging; setup_logging()\n"
            "import torchao.optim, hybrid_rl.build, hybrid_rl.trainer\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "Failed to load" not in out and "Enum subclass" not in out, out


def test_our_own_warnings_still_pass():
    code = ("from hybrid_rl.utils.logs import setup_logging; setup_logging()\n"
            "import logging; logging.getLogger('torchao').warning('Something a user must know')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "Something a user must know" in r.stderr
