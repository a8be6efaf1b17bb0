"""Fixtures for the reward tests: a user reward module that worker processes can import."""

import sys
import textwrap

import pytest

USER_REWARDS = """
import math
import os
import signal
import sys
import time


def length(response, sample):
    return len(response) / 10


def slow(response, sample):
    time.sleep(float(sample.get("sleep", 0.3)))
    return 1.0


def sleep_forever(response, sample):
    time.sleep(3600)
    return 1.0


def stuck_in_c(response, sample):
    # SIGALRM blocked: the in-worker time limit cannot fire, like a hang inside C code.
    if response == "stuck":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    return 1.0


def crash(response, sample):
    time.sleep(float(sample.get("sleep", 0.0)))
    if response == "crash":
        os._exit(3)
    return 1.0


def boom(response, sample):
    raise RuntimeError(f"boom on {response!r}")


def nan(response, sample):
    return math.nan


def infinite(response, sample):
    return math.inf


def not_a_number(response, sample):
    return "high"


def torch_loaded(response, sample):
    return float("torch" in sys.modules)


def make_constant(value):
    def constant(response, sample):
        return value

    return constant
"""


@pytest.fixture(scope="session")
def user_rewards_module(tmp_path_factory):
    """Name of an importable module of user rewards (on sys.path, which spawned workers inherit)."""
    folder = tmp_path_factory.mktemp("user_rewards")
    (folder / "hr_test_user_rewards.py").write_text(textwrap.dedent(USER_REWARDS))
    sys.path.insert(0, str(folder))
    yield "hr_test_user_rewards"
    sys.path.remove(str(folder))
