"""`hybrid_rl.algos` is pure: it imports torch and the standard library only (no torch.distributed)."""

import ast
import sys
from pathlib import Path

import hybrid_rl.algos

ALGOS_DIR = Path(hybrid_rl.algos.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module)
    return modules


def test_algos_imports_only_torch_and_stdlib():
    files = sorted(ALGOS_DIR.glob("*.py"))
    assert files
    for path in files:
        for module in _imported_modules(path):
            top = module.split(".")[0]
            assert top in sys.stdlib_module_names or top == "torch", f"{path.name} imports {module}"
            assert not module.startswith("torch.distributed"), f"{path.name} imports {module}"
