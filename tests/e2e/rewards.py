"""User reward functions for the end-to-end tests (plugged in as `reward.fn=tests.e2e.rewards:...`)."""


def length_parity(response: str, sample) -> float:
    """1 for responses of even length: varied scores even from a random model (dynamic sampling needs them)."""
    return float(len(response) % 2 == 0)
