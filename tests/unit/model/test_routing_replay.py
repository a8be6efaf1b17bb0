"""Routing replay on transformers' own Qwen3-MoE (tiny, built offline): the selected experts are the replayed
ones, the weights come from the trainer's router at them (so it still learns), exact under activation
checkpointing."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.model.loading import enable_activation_checkpointing, load_causal_lm
from hybrid_rl.model.routing_replay import record_routes, replay_routes, route_dtype, routers

IDS = torch.tensor([[5, 17, 200, 33, 8, 90, 41, 7, 300, 12, 64, 3], [9, 9, 120, 77, 2, 51, 18, 250, 6, 44, 100, 1]])


@pytest.fixture
def model(tiny_models):
    return load_causal_lm(tiny_models["qwen3_moe"])


def selected_experts(model) -> tuple[list, list]:
    """Hooks recording the experts each layer's expert block is handed (what it computes with)."""
    seen, handles = [], []
    for layer in model.model.layers:
        handles.append(layer.mlp.experts.register_forward_hook(
            lambda _m, args, _out: seen.append(args[1].detach().clone())))
    return seen, handles


def shifted(routes: torch.Tensor, experts: int) -> torch.Tensor:
    """Other valid routes: every expert id moved by one (still top_k distinct experts per token)."""
    return ((routes.long() + 1) % experts).to(routes.dtype)


def test_recorded_routes_are_compact_and_replaying_them_changes_nothing(model):
    with torch.no_grad(), record_routes(model) as rec:
        plain = model(input_ids=IDS).logits
    routes = rec.routes()
    assert routes.dtype == torch.uint8 == route_dtype(8)
    assert routes.shape == (IDS.numel(), len(routers(model)), 2)
    with torch.no_grad(), replay_routes(model, routes) as stats:
        again = model(input_ids=IDS).logits
    assert torch.equal(plain, again)
    assert stats.agreement == 1.0


def test_replay_uses_the_given_experts_and_the_router_still_learns(model):
    with torch.no_grad(), record_routes(model) as rec:
        model(input_ids=IDS)
    forced = shifted(rec.routes(), 8)
    seen, handles = selected_experts(model)
    with replay_routes(model, forced) as stats:
        out = model(input_ids=IDS).logits
    for h in handles:
        h.remove()
    for layer, chosen in enumerate(seen):
        assert torch.equal(chosen, forced[:, layer].long())
    assert stats.agreement < 0.05  # the router's own choice is measured before the replay overrides it
    out.float().log_softmax(-1)[..., 0].sum().backward()
    for r in routers(model):
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_replay_is_exact_under_activation_checkpointing(tiny_models):
    grads = []
    for checkpointing in (False, True):
        model = load_causal_lm(tiny_models["qwen3_moe"])
        if checkpointing:
            enable_activation_checkpointing(model)
        with torch.no_grad(), record_routes(model) as rec:
            model(input_ids=IDS)
        with replay_routes(model, shifted(rec.routes(), 8)):
            model(input_ids=IDS).logits.float().log_softmax(-1)[..., 3].sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=1e-6, msg=n)


def test_routes_of_the_wrong_shape_are_an_error(model):
    with pytest.raises(ValueError, match="MoE layers"):
        with replay_routes(model, torch.zeros(IDS.numel(), 5, 2, dtype=torch.uint8)):
            pass
