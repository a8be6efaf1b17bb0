"""`scripts/gpu_check.sh` names the GPU checks one by one (a lent GPU's time limit cuts a run short): every name it
runs must exist, and every check in tests/gpu must be among them. A renamed test would otherwise be skipped there,
on the one day a GPU is lent, unnoticed."""

import ast
import re

from tests.conftest import REPO
from tests.gpu import test_train


def _checks() -> list[str]:
    text = (REPO / "scripts" / "gpu_check.sh").read_text()
    block = re.search(r"^checks=\((.*?)^\)", text, re.S | re.M).group(1)
    return [line.split("#")[0].strip().strip('"') for line in block.splitlines() if line.split("#")[0].strip()]


def _test_functions(path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


def test_the_gpu_script_runs_every_gpu_check_by_a_name_that_exists():
    checks = _checks()
    files = {c.split("::")[0] for c in checks}
    assert files == {f"tests/gpu/{p.name}" for p in (REPO / "tests" / "gpu").glob("test_*.py")}
    for check in checks:
        if "::" not in check:
            continue
        path, node = check.split("::")
        name, case = re.fullmatch(r"(\w+)\[(.+)\]", node).groups()
        assert name in _test_functions(REPO / path), check
        assert case in test_train.CASES, check
    named = {c.split("[")[1].rstrip("]") for c in checks if "test_train.py::" in c}
    assert named == set(test_train.CASES)
