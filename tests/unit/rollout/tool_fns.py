"""Tools for the runner's tests (imported by path in the tool workers)."""

import os
import time


def echo(text: str) -> str:
    """Return the text.

    Args:
        text: What to return.
    """
    return text


def hang(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def stubborn(seconds: float) -> str:
    """Sleep and ignore every interruption (like a call stuck in C code).

    Args:
        seconds: How long.
    """
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            time.sleep(0.05)
        except BaseException:  # noqa: BLE001, S110 - the point: the worker's own time limit cannot stop it
            pass
    return "done"


def crash(code: int) -> str:
    """Kill the worker process.

    Args:
        code: The exit code.
    """
    os._exit(code)


def flood(n: int) -> str:
    """Return a very long text.

    Args:
        n: Its length in characters.
    """
    return "x" * n


def fail(message: str) -> str:
    """Raise an error.

    Args:
        message: The error message.
    """
    raise ValueError(message)


def unavailable(service: str) -> str:
    """Fail as a tool whose service is down (an infrastructure failure, not the model's).

    Args:
        service: The service's name.
    """
    from hybrid_rl.rollout.tools import ToolInfraError

    raise ToolInfraError(f"{service} is down")


class Counter:
    """An environment: a counter the model increments; the reward is 1 when it reaches the row's target."""

    def __init__(self):
        self.value, self.target = 0, 0

    def reset(self, target: int = 3, **row) -> str:
        self.value, self.target = 0, int(target)
        return f"Increment the counter to {self.target}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: The amount to add.
        """
        self.value += by
        return self.value

    def reward(self) -> float:
        return float(self.value == self.target)
