"""``hybrid_rl.rewards`` is a pure bottom layer at run time too: using it, in a fresh interpreter, loads no torch,
vLLM or Hydra, nor anything else of hybrid_rl (the static rule: tests/unit/rewards/test_import_rule.py)."""

import subprocess
import sys


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
