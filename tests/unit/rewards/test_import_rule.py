"""``hybrid_rl.rewards`` is a pure bottom layer: stdlib and sympy only, nothing else from hybrid_rl."""

import ast
import subprocess
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


def test_using_the_rewards_loads_no_torch_vllm_or_hydra():
    code = (
        "import sys\n"
        "from hybrid_rl.rewards import Rubric, RubricItem, resolve_reward\n"
        "from hybrid_rl.rewards import math, format, code, sandbox\n"
        "r = Rubric([RubricItem('math', resolve_reward('math')), RubricItem('format', resolve_reward('format'))])\n"
        "r.score([r'\\boxed{x^2}'], [{'ground_truth': 'x*x'}])\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'hydra', 'omegaconf', 'transformers')]\n"
        "other = [m for m in sys.modules if m.startswith('hybrid_rl.') and not m.startswith('hybrid_rl.rewards')]\n"
        "print(bad, other)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[] []", out.stderr
