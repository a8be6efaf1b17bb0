"""Multi-turn trajectories as token ids, for each supported chat-template family, on the models' own templates and
real tokenizers where available (`templates.py`): the ids trained are, id for id, those the engine saw and those the
template gives for the whole conversation; the loss mask covers exactly the model's tokens; boundary tokens are
context; a template that rewrites earlier turns is refused with a clear error. The engine is scripted (token ids
per turn); the tools run in the real tool runner."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.rollout.chat_template import FAMILIES, TemplateError, ToolSuffix, detect_family
from hybrid_rl.rollout.multi_turn import ToolLoop, TurnLimits
from hybrid_rl.rollout.tool_calls import get_parser
from hybrid_rl.rollout.trajectory import Trajectory
from hybrid_rl.types import Generation
from tests.unit.rollout.conftest import CALC
from tests.unit.rollout.templates import CALL_TEXT, FAMILY_OF, NAMES, call_message, call_text, tokenizer_for

SCHEMAS = [t.schema for t in CALC]


class Scripted:
    """An engine that answers turn k with the k-th scripted ids (log-prob -0.5 each) and records what it was sent."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.seen = turns, []

    def __call__(self, contexts, budgets, seeds):
        out = []
        for ctx, budget in zip(contexts, budgets, strict=True):
            ids = self.turns[len(self.seen)][:budget]
            self.seen.append(list(ctx))
            out.append(Generation(0, ids, [-0.5] * len(ids), "length" if len(ids) == budget else "stop"))
        return out


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _play(tok, turns, calc_runner, *, budget=512, max_turns=4):
    family = detect_family(tok.chat_template)
    suffix = ToolSuffix(tok, family, SCHEMAS)
    loop = ToolLoop(tok, suffix, get_parser(family.parser), calc_runner, TurnLimits(max_turns, 4, 64, budget))
    prompt = tok.apply_chat_template([{"role": "user", "content": "what is 2 + 3?"}], tools=SCHEMAS,
                                     add_generation_prompt=True, tokenize=False)
    traj = Trajectory(_enc(tok, prompt))
    engine = Scripted(turns)
    loop.run([traj], [None], engine, [7])
    return traj, engine, suffix


@pytest.mark.parametrize("name", NAMES)
def test_trained_ids_are_the_engines_and_the_mask_is_the_models_tokens(name, calc_runner, real_chat_templates):
    tok = tokenizer_for(name)
    family = FAMILIES[FAMILY_OF[name]]
    assert detect_family(tok.chat_template) == family
    eot = tok.convert_tokens_to_ids(family.end_of_turn)
    turn1 = _enc(tok, call_text(name)) + [eot]
    final = ("<think>\nit is 5\n</think>\n\n" if family.name == "qwen3" else "") + "The answer is 5."
    turn2 = _enc(tok, final) + [eot]
    traj, engine, suffix = _play(tok, [turn1, turn2], calc_runner)

    sample = traj.to_sample(0, 0, 0, {})
    full = torch.cat([sample.prompt_ids, sample.response_ids]).tolist()
    assert len(engine.seen) == 2 and traj.turns == 2 and traj.tool_calls == 1 and not traj.truncated
    for ctx in engine.seen:  # every request is a prefix of the trained ids: nothing was re-tokenised
        assert full[: len(ctx)] == ctx
    assert full == engine.seen[-1] + turn2  # the last request plus the last turn is the whole sample
    resp = sample.response_ids.tolist()
    ctx_ids = resp[len(turn1): len(resp) - len(turn2)]
    assert resp == turn1 + ctx_ids + turn2
    assert sample.loss_mask.tolist() == [True] * len(turn1) + [False] * len(ctx_ids) + [True] * len(turn2)
    assert sample.rollout_logprobs.tolist() == [-0.5] * len(turn1) + [0.0] * len(ctx_ids) + [-0.5] * len(turn2)
    assert ctx_ids[: len(suffix.boundary_ids)] == suffix.boundary_ids
    assert "5" in tok.decode(ctx_ids) and traj.log[0]["status"] == "ok"

    # The same conversation as an agent's history (the call in the OpenAI format), rendered by the template and
    # tokenized whole: the same text, and the same ids.
    (call,) = get_parser(family.parser)(family.answer_text(call_text(name)))
    rendered = tok.apply_chat_template([{"role": "user", "content": "what is 2 + 3?"}, call_message(name),
                                        {"role": "tool", "name": "calc", "content": "5",
                                         "tool_call_id": family.call_id(call, 0)},
                                        {"role": "assistant", "content": final}], tools=SCHEMAS,
                                       tokenize=False)
    assert tok.decode(full) + family.after_turn == rendered
    assert full + suffix.boundary_ids == _enc(tok, rendered)


def test_boundary_tokens_the_model_did_not_sample_are_context():
    """A ChatML turn stopped on <|endoftext|> (not <|im_end|>): the template's <|im_end|> and the newline after
    it are inserted as context (mask 0)."""
    tok = tokenizer_for("qwen2.5")
    suffix = ToolSuffix(tok, FAMILIES["chatml"], SCHEMAS)
    im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert suffix.boundary_ids == _enc(tok, "\n")
    ended = suffix.ids([{"role": "tool", "content": "5"}], ended=True)
    cut = suffix.ids([{"role": "tool", "content": "5"}], ended=False)
    assert cut == [im_end] + ended and ended[:1] == suffix.boundary_ids
    traj = Trajectory([1, 2])
    traj.add_model(_enc(tok, CALL_TEXT["chatml"]) + [endoftext], [-1.0] * (len(_enc(tok, CALL_TEXT["chatml"])) + 1))
    traj.add_context(cut)
    s = traj.to_sample(0, 0, 0, {})
    i = len(_enc(tok, CALL_TEXT["chatml"])) + 1
    assert s.response_ids[i] == im_end and not s.loss_mask[i] and not s.loss_mask[i + 1]
    assert s.response_ids[i + 1].item() == suffix.boundary_ids[0]


def test_a_template_that_rewrites_the_prefix_is_refused_clearly():
    tok = tokenizer_for("rewrites")
    with pytest.raises(TemplateError, match="not append-only.*'No tools yet.*becomes 'Tools were used"):
        ToolSuffix(tok, FAMILIES["chatml"], SCHEMAS)  # the probe tool exchange at start-up finds it
    # Qwen3 with a base turn without reasoning: the template drops the think block once the turn is not last.
    bare = FAMILIES["chatml"]
    with pytest.raises(TemplateError, match="not append-only"):
        ToolSuffix(tokenizer_for("qwen3"), bare, SCHEMAS)


def test_a_template_of_another_family_is_refused_at_start():
    with pytest.raises(TemplateError, match="does not end an assistant turn with '<\\|eot_id\\|>'"):
        ToolSuffix(tokenizer_for("qwen2.5"), FAMILIES["llama3"], SCHEMAS)


def test_budget_ends_a_trajectory_before_a_tool_result_that_does_not_fit(calc_runner):
    tok = tokenizer_for("qwen2.5")
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    turn1 = _enc(tok, CALL_TEXT["chatml"]) + [eot]
    traj, engine, _ = _play(tok, [turn1, _enc(tok, "5") + [eot]], calc_runner, budget=len(turn1) + 5)
    assert traj.truncated and traj.response_ids == turn1 and all(traj.loss_mask) and len(engine.seen) == 1


def test_a_turn_cut_by_the_budget_ends_the_trajectory(calc_runner):
    tok = tokenizer_for("qwen2.5")
    traj, engine, _ = _play(tok, [_enc(tok, "a long answer without end")], calc_runner, budget=3)
    assert traj.truncated and len(traj.response_ids) == 3 and traj.turns == 1
