"""The tool loop's rules that each fixed a defect users hit (issue 43): tool messages carry an id in their family's
format and a template that refuses a tool exchange stops the run at start-up, naming its family; Qwen3's thinking is
never executed; a call past `max_tool_calls` in a later turn is answered, not a silent end; a turn cut by
`max_turn_tokens` is marked; environment methods stuck past their limit cost their trajectory, not the rollout; the
overlong penalty counts the model's own tokens. Each runs on the models' own templates and real tokenizers of their
families (`templates.py`)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hybrid_rl.experience.batch import BatchSettings, outcome_scores
from hybrid_rl.experience.passes import PassOutputs
from hybrid_rl.experience.share import Share
from hybrid_rl.rollout.chat_template import FAMILIES, TemplateError, ToolSuffix, detect_family
from hybrid_rl.rollout.exchange import gather_index
from hybrid_rl.rollout.multi_turn import ToolLoop, TurnLimits
from hybrid_rl.rollout.tool_calls import ToolCall, get_parser
from hybrid_rl.rollout.tools import ToolRequest, ToolRunner
from hybrid_rl.rollout.tools._worker import INFRA, OK
from hybrid_rl.rollout.trajectory import Trajectory
from hybrid_rl.types import Generation, Scores
from tests.unit.rollout.conftest import CALC
from tests.unit.rollout.templates import CALL_TEXT, FAMILY_OF, NAMES, tokenizer_for

SCHEMAS = [t.schema for t in CALC]


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _play(tok, turns, calc_runner, limits):
    """Turn k of the single trajectory answers with `turns[k]` (ids); finish 'length' when the budget cut it."""
    family = detect_family(tok.chat_template)
    loop = ToolLoop(tok, ToolSuffix(tok, family, SCHEMAS), get_parser(family.parser), calc_runner, limits)
    prompt = tok.apply_chat_template([{"role": "user", "content": "2 + 3?"}], tools=SCHEMAS,
                                     add_generation_prompt=True, tokenize=False)
    traj, seen = Trajectory(_enc(tok, prompt)), []

    def generate(contexts, budgets, seeds):
        ids = turns[len(seen)][: budgets[0]]
        seen.append(list(contexts[0]))
        return [Generation(0, ids, [-0.5] * len(ids), "length" if len(ids) == budgets[0] else "stop")]

    loop.run([traj], [None], generate, [3])
    return traj, seen


# A call as the model writes it without an id of its own, and what the template writes for its result
@pytest.mark.parametrize(("name", "call", "result"), [
    ("mistral-nemo", '[TOOL_CALLS][{"name": "calc", "arguments": {"a": 2, "b": 3}}]',
     '[TOOL_RESULTS]{"content": 5, "call_id": "call00000"}[/TOOL_RESULTS]'),
    ("mistral-small-3.2", '[TOOL_CALLS]calc[ARGS]{"a": 2, "b": 3}', "[TOOL_RESULTS]call00000[TOOL_CONTENT]5[/TOOL_RESULTS]"),
    ("devstral", '[TOOL_CALLS]calc[ARGS]{"a": 2, "b": 3}', "[TOOL_RESULTS]5[/TOOL_RESULTS]"),
    ("mistral-v3", '[TOOL_CALLS][{"name": "calc", "arguments": {"a": 2, "b": 3}}]',
     '[TOOL_RESULTS]{"content": 5, "call_id": "call00000"}[/TOOL_RESULTS]')])
def test_mistral_tool_messages_carry_an_id_its_template_accepts(name, call, result, calc_runner, real_chat_templates):
    tok = tokenizer_for(name)
    eot = tok.convert_tokens_to_ids("</s>")
    turn1, turn2 = _enc(tok, call) + [eot], _enc(tok, "5") + [eot]
    traj, seen = _play(tok, [turn1, turn2], calc_runner, TurnLimits(3, 3, 64, 512))
    assert traj.turns == 2 and traj.log[0]["status"] == "ok" and not traj.infra_failed
    assert tok.decode(traj.response_ids[len(turn1): len(traj.response_ids) - len(turn2)]) == result


def test_the_models_own_mistral_call_id_is_the_tool_messages():
    calls = get_parser("mistral")('[TOOL_CALLS] [{"name": "calc", "arguments": {"a": 1}, "id": "Ab3dE6gH9"}]')
    assert calls == [ToolCall("calc", {"a": 1}, id="Ab3dE6gH9")]
    suffix = ToolSuffix(tokenizer_for("mistral-nemo"), FAMILIES["mistral"], SCHEMAS)
    assert suffix.tool_message(calls[0], "5", 4)["tool_call_id"] == "Ab3dE6gH9"
    assert suffix.tool_message(ToolCall("calc", id="short"), "5", 4)["tool_call_id"] == "call00004"


def test_a_template_that_refuses_a_tool_exchange_stops_the_run_at_start_naming_its_family():
    tok = tokenizer_for("smollm2")
    loop = "{% for message in messages %}"
    assert loop in tok.chat_template
    tok.chat_template = tok.chat_template.replace(loop, loop + "{% if message['role'] == 'tool' %}"
                                                  "{{ raise_exception('tool messages need a tool_call_id') }}{% endif %}")
    with pytest.raises(TemplateError, match="chatml.*tool exchange.*tool messages need a tool_call_id"):
        ToolSuffix(tok, FAMILIES["chatml"], SCHEMAS)


def test_llama3_json_calls_keep_semicolons_inside_strings():
    parse = get_parser("llama3_json")
    one = parse('{"name": "python", "parameters": {"code": "x = 1; print(x)"}}')
    assert one == [ToolCall("python", {"code": "x = 1; print(x)"})]
    two = parse('<|python_tag|>{"name": "a", "parameters": {"s": "p;q"}}; {"name": "b", "parameters": {}}')
    assert two == [ToolCall("a", {"s": "p;q"}), ToolCall("b", {})]
    bad = parse('{"name": "a", "parameters": {}}; {"name": ')
    assert bad[0] == ToolCall("a", {}) and len(bad) == 2 and bad[1].error


def test_a_qwen3_call_inside_the_thinking_block_is_not_executed(calc_runner):
    tok = tokenizer_for("qwen3")
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    thought = ('<think>\nmaybe <tool_call>\n{"name": "calc", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
               '</think>\n\nIt is 5.')
    traj, seen = _play(tok, [_enc(tok, thought) + [eot]], calc_runner, TurnLimits(3, 3, 64, 512))
    assert traj.turns == 1 and traj.tool_calls == 0 and traj.log == [] and len(seen) == 1
    # a turn that never closed its thinking block calls nothing either
    assert get_parser("hermes")("no call") == []
    assert FAMILIES["qwen3"].answer_text("<think>\n<tool_call>{}</tool_call>") == ""


def test_a_call_past_the_limit_in_a_later_turn_is_answered_with_the_limit_error(calc_runner):
    tok = tokenizer_for("qwen2.5")
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    call = _enc(tok, CALL_TEXT["chatml"]) + [eot]
    traj, seen = _play(tok, [call, call, _enc(tok, "5") + [eot]], calc_runner, TurnLimits(4, 1, 64, 512))
    assert traj.turns == 3 and len(seen) == 3 and not traj.truncated
    assert [c["status"] for c in traj.log] == ["ok", "error"]
    assert "limit of 1 tool calls" in traj.log[1]["result"]


def test_a_turn_cut_by_max_turn_tokens_is_marked_truncated(calc_runner):
    tok = tokenizer_for("qwen2.5")
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    long = _enc(tok, "a long answer that goes on and on")
    traj, _ = _play(tok, [long, _enc(tok, "5") + [eot]], calc_runner, TurnLimits(3, 3, 64, 512, max_turn_tokens=4))
    assert traj.truncated and traj.turns == 1 and len(traj.response_ids) == 4


class Blocking:
    """An environment whose tool blocks in C code (a lock wait: no time limit can interrupt it)."""

    def __init__(self):
        self.gate = threading.Event()

    def reset(self):
        return None

    def wait(self, seconds: float) -> str:
        """Block.

        Args:
            seconds: How long.
        """
        self.gate.wait(seconds)
        return "woke"

    def quick(self) -> str:
        """Answer at once."""
        return "here"


def test_an_environment_method_stuck_in_c_is_an_infrastructure_failure_within_its_bound():
    r = ToolRunner([], ("wait", "quick"), workers=1, timeout_s=0.5, grace_s=0.5)
    try:
        env = Blocking()
        start = time.monotonic()
        res = r.run([ToolRequest(ToolCall("wait", {"seconds": 30.0}), env), ToolRequest(ToolCall("quick"), env)])
        took = time.monotonic() - start
        assert took < 2.5, took
        assert res[0].status == INFRA and "did not return within 0.5s" in res[0].text
        assert res[1].status == OK and res[1].text == "here"
        env.gate.set()  # let the stuck thread go (it is a daemon: it could not hold the interpreter anyway)
    finally:
        r.close()


def test_overlong_shaping_counts_the_models_tokens_not_tool_or_template_tokens():
    traj = Trajectory([1, 2])
    traj.add_model([5] * 300, [-0.1] * 300)
    traj.add_context([6] * 400)
    short = Trajectory([1, 2])
    short.add_model([5] * 700, [-0.1] * 700)
    samples = [traj.to_sample(0, 0, 0, {}), short.to_sample(1, 1, 1, {})]
    index = gather_index(samples, 2)
    assert index.response_lens.tolist() == [700, 700] and index.model_lens.tolist() == [300, 700]
    share = Share(samples, torch.tensor([0, 1]), index, False, 2)
    s = BatchSettings("grpo", None, False, "k1", max_new_tokens=800, overlong_buffer=400, overlong_penalty=1.0,
                      rm_weight=0.0)
    total = outcome_scores(Scores(torch.zeros(2)), PassOutputs(), share, s)
    assert total.tolist() == pytest.approx([0.0, -0.75])


def test_plain_string_prompts_with_tools_get_one_clear_error(tmp_path):
    from hybrid_rl.data import load_prompt_dataset
    from hybrid_rl.rollout.chat_template import with_tools

    f = tmp_path / "rows.jsonl"
    f.write_text('{"prompt": "What is 2 + 3?"}\n')
    tok = with_tools(tokenizer_for("qwen2.5"), SCHEMAS)
    with pytest.raises(TemplateError, match="prompts are plain strings.*data.apply_chat_template=true"):
        load_prompt_dataset([str(f)], tok, max_prompt_tokens=4096)
    templated = load_prompt_dataset([str(f)], tok, max_prompt_tokens=4096, apply_chat_template=True)
    assert '"name": "calc"' in next(iter(templated)).prompt_text  # rendered with the tools' schemas
    env_given = with_tools(tokenizer_for("qwen2.5"), SCHEMAS, raw_prompts=True)  # an environment's reset may give them
    assert len(load_prompt_dataset([str(f)], env_given, max_prompt_tokens=4096)) == 1


def test_the_newer_call_formats_read_calls_and_report_malformed_ones():
    xml = get_parser("qwen3_coder")("Sure.\n<tool_call>\n<function=python>\n<parameter=code>\nx = 1; print(x)\n"
                                    "</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>")
    assert xml == [ToolCall("python", {"code": "x = 1; print(x)", "n": 3})]
    assert get_parser("qwen3_coder")("<tool_call>nothing</tool_call>")[0].error
    py = get_parser("pythonic")('[calc(a=2, b=3), lookup(key="a;b")]')
    assert py == [ToolCall("calc", {"a": 2, "b": 3}), ToolCall("lookup", {"key": "a;b"})]
    assert get_parser("pythonic")("The list is [1, 2].") == []
    assert get_parser("pythonic")("[calc(2)]")[0].error and get_parser("pythonic")("[calc(a=x)]")[0].error
    args = get_parser("mistral_args")('[TOOL_CALLS]calc[ARGS]{"a": 2}[TOOL_CALLS]calc[CALL_ID]Ab3dE6gH9[ARGS]{"b": 1}')
    assert args == [ToolCall("calc", {"a": 2}), ToolCall("calc", {"b": 1}, id="Ab3dE6gH9")]
    assert get_parser("mistral_args")("[TOOL_CALLS]calc{}")[0].error


@pytest.mark.parametrize("name", NAMES)
def test_each_family_is_detected_and_its_probe_exchange_renders(name, real_chat_templates):
    tok = tokenizer_for(name)
    family = FAMILIES[FAMILY_OF[name]]
    assert detect_family(tok.chat_template) == family
    suffix = ToolSuffix(tok, family, SCHEMAS)  # renders the probe tool exchange through the template
    assert "ok" in suffix.text([suffix.tool_message(ToolCall("probe"), "ok", 0)])


def test_the_sidecars_tool_batcher_serves_the_tool_loop_like_the_runner():
    """Sidecar mode hands the tool loop a ToolBatcher in the runner's place: the loop reads the environment's methods
    from it at construction (whether a user simulator answers)."""
    from hybrid_rl.rollout.tools.batcher import ToolBatcher

    runner = ToolRunner([], ("respond", "quick"), workers=1, timeout_s=0.5)
    batcher = ToolBatcher(runner)
    try:
        assert batcher.env_methods == {"respond", "quick"}
    finally:
        batcher.close()
        runner.close()
