"""The layout's rules, checked on the tree (as verl's validate_structure.py does): tests/unit mirrors hybrid_rl's
packages, no module outgrows the size budget, and tests/unit starts no process."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "hybrid_rl"
UNIT = REPO / "tests" / "unit"
MAX_LINES = 400

# Packages without a tests/unit/<pkg> folder, each with the reason.
NO_UNIT_FOLDER = {
    "demo": "the demo's tasks are data: tests/unit/data/test_arithmetic_task.py and test_tools_task.py; the demo "
            "itself runs under torchrun in tests/e2e/test_demo.py and test_tools_demo.py",
}

# Modules over MAX_LINES today. This list must only shrink: a module split below the budget leaves it (the test
# below fails until its line is removed), and no module joins it.
OVER_BUDGET = {
    "hybrid_rl/config.py",  # the typed config: one dataclass per group and their checks, read in one place
}

# Calls that start a process (tests that make them belong in tests/integration, tests/engine, tests/sidecar or
# tests/e2e: tests/unit is `make test-fast`, one process, about a minute).
PROCESS_STARTERS = {"spawn", "start_processes", "Popen", "Process", "run_torchrun", "check_output", "check_call"}
# Files of tests/unit that still start processes (by file name: the planner's tests move with the planner), each
# with the reason. This list must only shrink.
STARTS_PROCESSES: dict[str, str] = {}  # file name -> why it may start a process in tests/unit


def _packages() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


def test_every_package_has_its_unit_test_folder_or_a_reason():
    missing = [pkg for pkg in _packages() if not any((UNIT / pkg).glob("test_*.py")) and pkg not in NO_UNIT_FOLDER]
    assert not missing, f"add tests/unit/<pkg>/ for {missing}, or a reason in NO_UNIT_FOLDER"
    stale = [pkg for pkg in NO_UNIT_FOLDER if pkg not in _packages() or any((UNIT / pkg).glob("test_*.py"))]
    assert not stale, f"remove {stale} from NO_UNIT_FOLDER: the package is gone or has its folder now"


def test_no_module_is_over_the_line_budget_except_the_shrinking_list():
    lines = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {path for path, n in lines.items() if n > MAX_LINES}
    assert over <= OVER_BUDGET, f"over {MAX_LINES} lines: {sorted(over - OVER_BUDGET)} (split it; the list only shrinks)"
    assert OVER_BUDGET <= over, f"remove {sorted(OVER_BUDGET - over)} from OVER_BUDGET: now within the budget or gone"


def _process_calls(path: Path, root: Path = UNIT) -> list[str]:
    """Calls of a process starter (`subprocess.run` counted too), by name or attribute."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
        if name in PROCESS_STARTERS or (owner == "subprocess" and name == "run"):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(func)}(...)")
    return found


def test_no_unit_test_starts_a_process():
    files = sorted(UNIT.rglob("*.py"))
    calls = [c for p in files if p.name not in STARTS_PROCESSES for c in _process_calls(p)]
    assert not calls, "tests that start processes go to tests/integration/<pkg>:\n" + "\n".join(calls)
    quiet = sorted(set(STARTS_PROCESSES) - {p.name for p in files if _process_calls(p)})
    assert not quiet, f"remove {quiet} from STARTS_PROCESSES: they start no process in tests/unit now"


def test_the_process_check_sees_the_forms_it_forbids(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import subprocess, multiprocessing as mp, torch.multiprocessing as tmp\n"
                     "subprocess.run(['x'])\nsubprocess.Popen(['x'])\nmp.get_context('spawn').Process(target=f)\n"
                     "tmp.spawn(f, nprocs=2)\nrun_torchrun('w.py', tmp_path=p)\nrun(['not', 'a', 'process'])\n")
    assert [c.split(": ")[1] for c in _process_calls(probe, root=tmp_path)] == [
        "subprocess.run(...)", "subprocess.Popen(...)", "mp.get_context('spawn').Process(...)", "tmp.spawn(...)",
        "run_torchrun(...)"]
