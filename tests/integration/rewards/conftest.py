"""The reward tests' user reward module, for the pool's spawned workers here too."""

from tests.unit.rewards.conftest import user_rewards_module  # noqa: F401 - a fixture, shared with tests/unit/rewards
