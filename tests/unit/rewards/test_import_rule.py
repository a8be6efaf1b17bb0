"""``hybrid_rl.rewards`` is a pure bottom layer: stdlib and sympy only, nothing else from hybrid_rl."""

import ast
import sys
from pathlib import Path

import hybrid_rl.rewards

REWARDS_DIR = Path(hybrid_rl.rewards.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            modules.add(node.module)
    return modules


def test_rewards_import_only_stdlib_sympy_and_themselves():
    files = sorted(REWARDS_DIR.glob("*.py"))
    assert files
    for path in files:
        for module in _imported_modules(path):
            top = module.split(".")[0]
            allowed = top in sys.stdlib_module_names or top in ("sympy", "__future__")
            assert allowed or module.startswith("hybrid_rl.rewards"), f"{path.name} imports {module}"
