"""Collectives go through `hybrid_rl.distributed` helpers: no other module calls torch.distributed collectives directly.

A collective called with a tensor on the wrong device fails only on GPUs (nccl serves CUDA tensors,
gloo CPU ones), where this project's CI never runs; the helpers in `distributed/collectives.py` put every
payload on the communication device. The resharder (`hybrid_rl/weightsync/`) drives its own all-to-alls and the
in-process engine (`hybrid_rl/colocated/`) vLLM's groups, so those two are allowed too.
"""

import ast
from pathlib import Path

import torch

from hybrid_rl.distributed.collectives import comm_device_for
from hybrid_rl.distributed.mesh import backend_for

PACKAGE = Path(__file__).resolve().parents[3] / "hybrid_rl"
ALLOWED = ("distributed", "weightsync", "colocated")
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
    "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "monitored_barrier",
}


def _direct_collective_calls(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """`<alias>.<collective>(...)` where the alias is torch.distributed, or a collective imported from it."""
    tree = ast.parse(path.read_text())
    aliases, imported = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            imported |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    found = [f"{path.relative_to(root)}: imports {name} from torch.distributed" for name in imported]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in COLLECTIVES:
            continue
        owner = ast.unparse(node.func.value)
        if owner in aliases or owner == "torch.distributed":
            found.append(f"{path.relative_to(root)}:{node.lineno}: {owner}.{node.func.attr}(...)")
    return found


def test_no_module_outside_distributed_weightsync_and_colocated_calls_a_collective_directly():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in ALLOWED:
            continue
        offenders += _direct_collective_calls(path)
    assert not offenders, "call hybrid_rl.distributed.collectives instead:\n" + "\n".join(offenders)


def test_the_boundary_check_sees_the_forms_it_forbids(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text("import torch.distributed as d\nfrom torch import distributed\nfrom torch.distributed import "
                   "all_reduce as ar\nimport torch\nd.all_reduce(x)\ndistributed.barrier()\n"
                   "torch.distributed.broadcast(x, 0)\nd.is_initialized()\n")
    found = _direct_collective_calls(bad, tmp_path)
    assert len(found) == 4, found  # the import of all_reduce, and three calls; is_initialized is no collective


def test_a_cuda_world_serves_cpu_and_cuda_tensors_and_sends_payloads_from_its_gpu():
    assert backend_for(cuda=True) == "cpu:gloo,cuda:nccl"
    assert backend_for(cuda=False) == "gloo"
    assert comm_device_for(cuda=True, local_rank=3) == torch.device("cuda", 3)
    assert comm_device_for(cuda=False, local_rank=3) == torch.device("cpu")
