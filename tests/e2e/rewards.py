"""User reward functions for the end-to-end tests (plugged in as `reward.fn=tests.e2e.rewards:...`)."""


def length_parity(response: str, sample) -> float:
    """1 for responses of even length: varied scores even from a random model (dynamic sampling needs them)."""
    return float(len(response) % 2 == 0)


def constant(response: str, sample) -> float:
    """The same score for everything: every group looks alike to dynamic sampling."""
    return 1.0


def not_a_number(response: str, sample) -> float:
    """A broken reward: NaN must count as an error of this reward, never reach the advantages."""
    return float("nan")


SLOW_REWARD_S = 0.25


def slow(response: str, sample) -> float:
    """Takes a known time per sample, to measure how scoring overlaps the model passes."""
    import time

    time.sleep(SLOW_REWARD_S)
    return float(len(response) % 2 == 0)
