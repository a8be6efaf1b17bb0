"""Black-box agents: an agent written against the OpenAI client plays against the chat endpoint in front of a real
vLLM server (token-in/token-out); its calls are recorded as the ids the server saw, with the weight version that
sampled each, and stitched into trajectories.

One server start (random weights: what the model says does not matter here, which ids are recorded does).
"""

import sys

import pytest
import requests

from hybrid_rl.distributed.mesh import free_port
from hybrid_rl.rollout.chat_template import ToolSuffix, detect_family
from hybrid_rl.sidecar.auth import auth_headers
from hybrid_rl.sidecar.black_box import load_agent, play
from hybrid_rl.sidecar.chat_endpoint import ChatEndpoint
from hybrid_rl.sidecar.completions import GENERATE, CompletionClient, Router, parse_choice, request_body
from hybrid_rl.sidecar.stitch import stitch
from hybrid_rl.sidecar.versions import token_versions_of
from hybrid_rl.sidecar.vllm_server import ServerSpec, VLLMServer
from hybrid_rl.types import Sampling

pytestmark = pytest.mark.slow


def agent(base_url: str, row: dict) -> float:
    """What a user writes: the OpenAI client, a tool answered by the agent itself, then a conversation started over."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "user", "content": row["question"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "tool", "name": "python", "content": "42"}]
    client.chat.completions.create(model="policy", messages=messages)
    # Rewrites the history (drops the tool turn): not an extension, so a new sample
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Start over: 6 x 7?"}])
    return 0.5


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("chat_endpoint") / "server.log"
    s = VLLMServer(ServerSpec(model_path=tiny_models["qwen2"], tp=1, dtype="float32", port=free_port(),
                              max_model_len=512, seed=0, enforce_eager=True, log_path=str(log), python=sys.executable,
                              kv_cache_gb=0.25))
    try:
        s.start(timeout_s=300)
        s.post("/update_weight_version", {"new_version": "0"})  # the sidecar stamps every push; none here
        yield s
    finally:
        s.stop()


def test_an_openai_client_agent_is_recorded_as_the_ids_the_server_saw_and_stitched(server, tiny_models):
    from openai import OpenAI
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["qwen2"])
    family = detect_family(tok.chat_template)
    eot = ToolSuffix(tok, family).end_of_turn_id
    sampling = Sampling(max_tokens=12, temperature=1.0, stop_token_ids=(eot,))
    router = Router()
    router.set_servers([server.url])
    client = CompletionClient(max_inflight=2, progress_timeout_s=120)
    # the server's weight-version spans mapped to policy versions, as the agent rollout maps them ("0": version 7)
    endpoint = ChatEndpoint(client, tok, family, versions=lambda g: token_versions_of(g, {"0": 7}).tolist())
    try:
        ep = play(endpoint, load_agent("tests.sidecar.test_chat_endpoint:agent"), {"question": "What is 6 x 7?"},
                  episode="e0", seed=11, sampling=sampling, router=router)
        assert ep.error == "" and ep.reward == 0.5 and len(ep.calls) == 3
        first, second, third = ep.calls
        assert len(first.output_ids) <= 8  # the request's max_tokens lowers the run's budget
        # The second call extends the first: its prompt is the first's ids and the sampled ids, not a re-rendering
        held = [*first.prompt_ids, *first.output_ids]
        assert list(second.prompt_ids[:len(held)]) == held
        suffix = ToolSuffix(tok, family).ids([{"role": "tool", "name": "python", "content": "42"}],
                                             ended=first.output_ids[-1] == eot)
        assert list(second.prompt_ids[len(held):]) == suffix
        rendered = tok.apply_chat_template([{"role": "user", "content": "What is 6 x 7?"}], tokenize=False,
                                           add_generation_prompt=True)
        assert list(first.prompt_ids) == tok(rendered, add_special_tokens=False)["input_ids"]
        # What the server saw: the same ids and seed sent again sample the same ids with the same log-probs
        for k, c in enumerate(ep.calls):
            body = request_body(list(c.prompt_ids), sampling, 11 + k * 7919)
            body["sampling_params"]["max_tokens"] = len(c.output_ids)
            body["stream"] = False  # one JSON answer (the client streams, for its progress timeout)
            again = parse_choice(requests.post(f"{server.url}{GENERATE}", json=body, headers=auth_headers(), timeout=120).json()["choices"][0])
            assert list(again.token_ids) == list(c.output_ids)
            assert again.logprobs == pytest.approx(list(c.logprobs), abs=1e-4)
        # Stitched: one trajectory of two model turns (mask exactly on the sampled ids), and the rewritten
        # conversation a new sample
        one, two = ep.trajectories
        assert one.prompt_ids == list(first.prompt_ids)
        assert one.context == [*second.prompt_ids, *second.output_ids]
        own = [i for i, m in zip(one.response_ids, one.loss_mask, strict=True) if m]
        assert own == [*first.output_ids, *second.output_ids] and one.turns == 2
        assert two.prompt_ids == list(third.prompt_ids) and two.response_ids == list(third.output_ids)
        # every sampled id keeps the version that sampled it; the agent's context ids take the one before them
        assert all(list(c.versions) == [7] * len(c.output_ids) for c in ep.calls)
        assert one.versions == [7] * len(one.response_ids) and two.versions == [7] * len(two.response_ids)

        # An agent that edits the reply it got (here: strips it) is rendered whole, not given the recorded ids; the
        # stitch rule keeps it in the trajectory only where the re-rendered ids still extend it
        base = endpoint.open("e2", sampling=sampling, router=router, seed=5)
        api = OpenAI(base_url=base, api_key="unused", max_retries=0)
        asked = [{"role": "user", "content": "What is 6 x 7?"}]
        reply = api.chat.completions.create(model="policy", messages=asked).choices[0].message.content
        edited = [*asked, {"role": "assistant", "content": "<" + reply + ">"}, {"role": "user", "content": "Sure?"}]
        api.chat.completions.create(model="policy", messages=edited)
        calls = endpoint.close("e2")
        text = tok.apply_chat_template(edited, tokenize=False, add_generation_prompt=True)
        assert list(calls[1].prompt_ids) == tok(text, add_special_tokens=False)["input_ids"]
        assert len(stitch(calls)) == 2  # "<" ... ">" around the reply: the sampled ids are not a prefix any more

        # Bad requests are the agent's error, said plainly; an unknown path is a 404
        base = endpoint.open("e1", sampling=sampling, router=router)
        r = requests.post(f"{base}/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                            "stream": True}, timeout=30)
        assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
        assert requests.post(f"{endpoint.url}/v1/chat/completions", json={}, timeout=30).status_code == 404
        assert endpoint.close("e1") == []
    finally:
        endpoint.shutdown()
        client.close()
