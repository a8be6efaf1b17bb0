"""A config names functions the run will call: names that are never a reward, tool or parser are refused where they
are resolved (rewards, tools, environments, agents, tool-call parsers), before anything is called."""

from __future__ import annotations

import sys
import types

import pytest

from hybrid_rl.rewards.base import resolve_reward
from hybrid_rl.rollout.tool_calls import get_parser
from hybrid_rl.rollout.tools.spec import load_object

REFUSED = ["os:system", "posix:system", "subprocess:run", "subprocess:Popen", "builtins:eval", "builtins:exec",
           "shutil:rmtree", "os.path:join", "sys:exit", "importlib:import_module", "pickle:loads"]


@pytest.mark.parametrize("name", REFUSED)
def test_a_reward_naming_the_standard_librarys_process_and_file_modules_is_refused(name):
    with pytest.raises(ValueError, match=rf"reward '{name}': refused: it names"):
        resolve_reward(name)


@pytest.mark.parametrize("resolve", [lambda n: load_object(n, "rollout.tools entry"), get_parser],
                         ids=["tool", "parser"])
def test_tools_and_parsers_refuse_them_too(resolve):
    for name in ("os:system", "subprocess:check_output", "builtins:exec"):
        with pytest.raises(ValueError, match="refused"):
            resolve(name)


def test_reaching_them_through_attributes_or_a_re_export_is_refused(monkeypatch):
    relay = types.ModuleType("hr_relay_rewards")
    from os import system  # noqa: PLC0415 - the re-export under test

    relay.system = system
    relay.os = __import__("os")
    monkeypatch.setitem(sys.modules, "hr_relay_rewards", relay)
    for name in ("hr_relay_rewards:system", "hr_relay_rewards:os.system", "json:codecs.sys.exit",
                 "json:__builtins__", "hr_relay_rewards:__class__"):
        with pytest.raises(ValueError, match="refused"):
            resolve_reward(name)


def test_ordinary_user_functions_still_resolve():
    assert resolve_reward("json:dumps") is __import__("json").dumps
    from tests.unit.rollout.tool_fns import echo

    assert load_object("tests.unit.rollout.tool_fns:echo", "tool") is echo
