"""KL coefficient controllers."""

import pytest

from hybrid_rl.algos import AdaptiveKLController, FixedKLController


def test_fixed_controller_never_moves():
    controller = FixedKLController(0.05)
    controller.update(current_kl=100.0, n_steps=256)
    assert controller.value == 0.05


@pytest.mark.parametrize(
    ("current_kl", "expected"),
    [
        # target 6, horizon 10000, n_steps 256 -> n_steps/horizon = 0.0256
        (9.0, 0.2 * (1 + 0.2 * 0.0256)),  # 9/6 - 1 = 0.5, clipped to 0.2 -> 0.2 * 1.00512 = 0.201024
        (3.0, 0.2 * (1 - 0.2 * 0.0256)),  # 3/6 - 1 = -0.5, clipped to -0.2 -> 0.198976
        (6.6, 0.2 * (1 + 0.1 * 0.0256)),  # 6.6/6 - 1 = 0.1 (inside the clip) -> 0.200512
        (6.0, 0.2),  # on target: no change
    ],
)
def test_adaptive_controller_by_hand(current_kl, expected):
    controller = AdaptiveKLController(init_coef=0.2, target=6.0, horizon=10000)
    controller.update(current_kl, n_steps=256)
    assert controller.value == pytest.approx(expected)


@pytest.mark.parametrize("make", [lambda: FixedKLController(0.1), lambda: AdaptiveKLController(0.1, 1.0, 100)])
def test_controllers_round_trip_through_state_dict(make):
    controller = make()
    controller.update(2.0, n_steps=10)
    restored = make()
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    controller.update(2.0, n_steps=10)
    restored.update(2.0, n_steps=10)
    assert restored.value == controller.value


def test_adaptive_controller_rejects_nonpositive_target():
    with pytest.raises(ValueError, match="target and horizon must be > 0"):
        AdaptiveKLController(0.1, target=0.0, horizon=100)
