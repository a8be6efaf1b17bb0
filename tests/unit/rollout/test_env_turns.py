"""Per-turn rewards and user turns from an environment: a tool's `EnvReply` reward is kept on its model turn and
summed into the environment's reward; a reply with role "user" and the user simulator's (`respond`) messages are
rendered as user turns (context, mask 0), `None` from `respond` ends the dialogue; the model cannot call `respond`."""

from __future__ import annotations

import json

import pytest

from hybrid_rl.rollout.chat_template import FAMILIES, TemplateError, ToolSuffix
from hybrid_rl.rollout.environment import open_environment, trajectory_fields
from hybrid_rl.rollout.multi_turn import ToolLoop, TurnLimits
from hybrid_rl.rollout.tool_calls import hermes
from hybrid_rl.rollout.tools import EnvironmentReward, ToolRunner, load_environment
from hybrid_rl.rollout.trajectory import Trajectory
from hybrid_rl.types import Generation
from tests.unit.rollout.conftest import CALC
from tests.unit.rollout.templates import tokenizer_for


def _call(name, args):
    return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def _play(env_path, turns, max_turns=6):
    tok = tokenizer_for("qwen2.5")
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    spec = load_environment(env_path)
    runner = ToolRunner([], spec.handlers, workers=1, timeout_s=5.0)
    suffix = ToolSuffix(tok, FAMILIES["chatml"], list(spec.schemas))
    loop = ToolLoop(tok, suffix, hermes, runner, TurnLimits(max_turns, 4, 64, 1024))
    env, opening = open_environment(spec, tok, suffix.tools, {}, tok("q", add_special_tokens=False)["input_ids"])
    traj, seen = Trajectory(list(opening.prompt_ids)), []

    def generate(contexts, budgets, seeds):
        seen.append(list(contexts[0]))
        ids = tok(turns[len(seen) - 1], add_special_tokens=False)["input_ids"] + [eot]
        return [Generation(0, ids, [-0.5] * len(ids), "stop")]

    try:
        loop.run([traj], [env], generate, [0])
    finally:
        runner.close()
    return tok, spec, env, traj, seen


def test_step_rewards_are_kept_per_turn_and_user_turns_are_rendered_as_the_user():
    turns = [_call("check", {"answer": 4}), _call("ask", {}), _call("check", {"answer": 5}), "It is 5.",
             "Yes, 5."]
    tok, spec, env, traj, seen = _play("tests.unit.rollout.env_dialogue:Dialogue", turns)
    assert traj.turns == 5 and len(seen) == 5 and traj.tool_calls == 3 and traj.user_turns == 1
    assert traj.turn_rewards == [-0.5, 0.0, 0.5, 0.0, 0.0]
    text = tok.decode(traj.response_ids)
    assert "<|im_start|>user\nI meant 2 + 3.<|im_end|>" in text  # a tool's reply as the user
    assert "<|im_start|>user\nAre you sure?<|im_end|>" in text  # the user simulator's follow-up
    assert text.endswith("Yes, 5.<|im_end|>")  # respond returned None: the dialogue ended after the model's turn
    assert [c["name"] for c in traj.log] == ["check", "ask", "check"] and traj.log[0]["reward"] == -0.5
    fields = trajectory_fields(spec, env, traj)
    assert fields["turn_rewards"] == traj.turn_rewards and fields["env_reward"] == pytest.approx(1.0)
    assert EnvironmentReward()("", fields) == pytest.approx(1.0)


def test_rewards_per_turn_without_reward_count_and_the_model_cannot_call_respond():
    spec = load_environment("tests.unit.rollout.env_dialogue:StepsOnly")
    assert spec.has_reward and not spec.has_respond and spec.handlers == ("check",)
    _, spec, env, traj, _ = _play("tests.unit.rollout.env_dialogue:StepsOnly",
                                  [_call("check", {"answer": 1}), _call("respond", {"message": "x"}), "done"])
    assert traj.turn_rewards == [0.25, 0.0, 0.0] and traj.log[1]["status"] == "error"
    assert trajectory_fields(spec, env, traj)["env_reward"] == pytest.approx(0.25)
    dialogue = load_environment("tests.unit.rollout.env_dialogue:Dialogue")
    assert dialogue.has_respond and "respond" not in dialogue.methods and "respond" in dialogue.handlers


def test_a_template_that_rewrites_earlier_turns_after_a_user_message_is_refused_at_start_with_a_user_simulator():
    ToolSuffix(tokenizer_for("qwen2.5"), FAMILIES["chatml"], user_turns=True)  # ChatML appends a user turn
    with pytest.raises(TemplateError, match="answers as the user.*not append-only"):
        ToolSuffix(tokenizer_for("qwen3"), FAMILIES["qwen3"], user_turns=True)  # drops the earlier reasoning
    schemas = [t.schema for t in CALC]
    ToolSuffix(tokenizer_for("llama3.1"), FAMILIES["llama3"], schemas, user_turns=True)
    with pytest.raises(TemplateError, match="answers as the user.*not append-only.*AVAILABLE_TOOLS"):
        # Mistral's real templates write the tools before the last user message: a new one moves them
        ToolSuffix(tokenizer_for("mistral-nemo"), FAMILIES["mistral"], schemas, user_turns=True)
