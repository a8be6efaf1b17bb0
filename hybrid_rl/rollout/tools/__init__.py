"""Tools and environments for multi-turn rollouts: what the model may call, and the processes that run the calls.

* `spec.py`: a tool is a typed Python function with a docstring, named by import path (`rollout.tools`); its JSON
  schema (transformers' `get_json_schema`) goes to the chat template's `tools=`. An environment
  (`rollout.environment`) is a class whose public methods are tools, one instance per trajectory.
* `builtin.py`: the built-in `python` tool: the code sandbox of the code reward, bounded in time and output.
* `runner.py` / `_worker.py`: the calls of a turn run in parallel worker processes; a call that hangs, crashes or
  floods is bounded and costs that call only.
"""

from hybrid_rl.rollout.tools.runner import ToolRequest, ToolResult, ToolRunner
from hybrid_rl.rollout.tools.spec import (
                                          Environment,
                                          EnvironmentReward,
                                          EnvReply,
                                          ToolInfraError,
                                          ToolSpec,
                                          load_environment,
                                          resolve_tools,
)

__all__ = ["EnvReply", "Environment", "EnvironmentReward", "ToolInfraError", "ToolRequest", "ToolResult", "ToolRunner", "ToolSpec", "load_environment",
           "resolve_tools"]
