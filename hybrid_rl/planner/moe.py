"""What a mixture of experts adds to a plan beyond its parameters and activations (which `param_count` and
`activations` count): the recorded routes and vLLM's fused-MoE workspace.

* **Routes** (`model.moe.router_replay=rollout`): vLLM records, for every prompt and response token of a sample, the
  experts each sparse layer chose, `[tokens, layers, top_k]` in the smallest integer type that holds an expert id
  (`model/routing_replay.route_dtype`: one byte up to 256 experts). A sample carries them from the rollout to the
  rank that trains on it (`rollout/exchange.send_to_owners`: one all-to-all of their raw bytes, sent and received
  through the communication device) and each micro-batch takes its samples' rows to the device, with one byte per
  token saying whether the row is known (`model/forward._with_routes`). The samples themselves live in host memory:
  on a CPU device they count in every phase from the rollout to the update; on CUDA they are a host note, and what
  the device holds is the exchange's two copies (in the rollout phase) and a micro-batch's rows in each pass.
* **vLLM's fused-MoE workspace** (CUDA): `vllm_memory.fused_moe_workspace_bytes`.
"""

from __future__ import annotations

from hybrid_rl.planner.inputs import PlanInputs
from hybrid_rl.planner.param_count import ArchDims
from hybrid_rl.planner.result import Item


def route_id_bytes(num_experts: int) -> int:
    """Bytes of one expert id as a sample carries it (`routing_replay.route_dtype`: uint8, int16, int32)."""
    return 1 if num_experts <= 256 else 2 if num_experts <= 32768 else 4


def route_bytes_per_token(d: ArchDims) -> int:
    """A token's routes: every sparse layer's `top_k` expert ids (0 for a dense model)."""
    return d.moe_layers * d.top_k * route_id_bytes(d.num_experts) if d.num_experts else 0


def records_routes(x: PlanInputs) -> bool:
    return x.rollout.enabled and x.router_replay == "rollout" and x.actor.dims.moe_layers > 0


def step_routes_bytes(x: PlanInputs) -> int:
    """The routes of the samples one rank trains on in a step."""
    return x.step_tokens * route_bytes_per_token(x.actor.dims) if records_routes(x) else 0


def routes_items(x: PlanInputs, phase: str) -> list[Item]:
    if not records_routes(x) or phase in ("startup", "sync"):
        return []
    held, per_token, items = step_routes_bytes(x), route_bytes_per_token(x.actor.dims), []
    what = f"routes ({x.step_tokens} tok x {per_token} B)"
    if x.device.kind == "cpu":  # the samples are in host memory, which is this device
        items.append(Item("routes", f"{what}, the step's samples", held))
    if phase == "rollout":
        items.append(Item("routes", "routes exchange (sent + received)", 2 * held))
    micro = {"old_logp": x.pass_tokens, "reference": x.pass_tokens, "update": x.update_tokens}.get(phase)
    if micro:
        items.append(Item("routes", f"routes of a {micro}-token micro-batch", micro * (per_token + 1)))
    return items


def moe_notes(x: PlanInputs) -> list[str]:
    a = x.actor
    d = a.dims
    if not d.moe_layers:
        return []
    notes = [f"mixture of experts: {a.numel / 1e9:.2f}B parameters, {a.active_numel / 1e9:.2f}B active per token "
             f"({d.top_k} of {d.num_experts} experts in {d.moe_layers} of {d.num_layers} layers); memory holds all "
             f"of them, activations count {d.top_k} experts per token"]
    if records_routes(x):
        where = "host memory (counted above: the device is the host)" if x.device.kind == "cpu" else "host memory"
        notes.append(f"routing replay (rollout): {route_bytes_per_token(d)} bytes of routes per token; the "
                     f"{x.step_tokens} tokens of a rank's samples carry {step_routes_bytes(x) / 2**20:.1f} MiB in "
                     f"{where}")
    return notes
