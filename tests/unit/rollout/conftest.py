"""The tool runner serving the `calc` test tool (`templates.calc`), shared by a module's tests."""

import pytest

from hybrid_rl.rollout.tools import ToolRunner, resolve_tools

CALC = resolve_tools(["tests.unit.rollout.templates:calc"])


@pytest.fixture(scope="module")
def calc_runner():
    r = ToolRunner(CALC, workers=1, timeout_s=5.0)
    yield r
    r.close()
