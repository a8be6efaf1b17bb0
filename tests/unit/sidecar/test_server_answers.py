"""A server's answers are checked before they reach the trainer, and the chat endpoint bounds what it reads."""

import socket

import pytest

from hybrid_rl.rollout.chat_template import FAMILIES
from hybrid_rl.sidecar.agent import episode_id
from hybrid_rl.sidecar.chat_endpoint import MAX_BODY_BYTES, ChatEndpoint
from hybrid_rl.sidecar.completions import CompletionClient, parse_choice, parse_stream


def _choice(ids, lps):
    return {"token_ids": ids, "logprobs": {"content": [{"logprob": x} for x in lps]}, "finish_reason": "length",
            "weight_versions": [{"version": "v1", "start": 0, "end": len(ids)}]}


def test_an_answer_a_correct_server_cannot_give_is_refused():
    assert parse_choice(_choice([0, 9], [-0.5, 0.0]), max_tokens=2, vocab=10).token_ids == (0, 9)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        parse_choice(_choice([3, 10], [-0.5, -1.0]), max_tokens=4, vocab=10)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        parse_choice(_choice([-1], [-0.5]), vocab=10)
    with pytest.raises(ValueError, match="3 tokens for a request of at most 2"):
        parse_choice(_choice([1, 2, 3], [-0.5] * 3), max_tokens=2, vocab=10)
    for bad in (float("nan"), float("inf"), float("-inf"), 3.0):
        with pytest.raises(ValueError, match="not finite numbers <= 0"):
            parse_choice(_choice([1], [bad]), max_tokens=2, vocab=10)
    stream = [b'data: {"choices": [{"token_ids": [1, 99], "logprobs": {"content": [{"logprob": -1}, {"logprob": -1}]},'
              b' "finish_reason": "length", "weight_versions": [{"version": "v", "start": 0, "end": 2}]}]}']
    with pytest.raises(ValueError, match="vocabulary"):
        parse_stream(stream, max_tokens=2, vocab=50)


def test_the_chat_endpoint_refuses_a_huge_body_unread_and_episode_ids_carry_128_bits():
    client = CompletionClient(max_inflight=1, progress_timeout_s=5)
    endpoint = ChatEndpoint(client, tokenizer=None, family=FAMILIES["chatml"])  # the body is refused before either is read
    try:
        host, port = endpoint._http.server_address[:2]
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(f"POST /episodes/e/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {2**40}\r\n"
                      "Content-Type: application/json\r\n\r\n{".encode())
            answer = b""
            while chunk := s.recv(4096):  # the endpoint answers and closes the connection
                answer += chunk
            answer = answer.decode()
        assert answer.startswith("HTTP/1.0 413") or answer.startswith("HTTP/1.1 413"), answer[:200]
        assert str(MAX_BODY_BYTES) in answer
    finally:
        endpoint.shutdown()
        client.close()
    ids = {episode_id(7) for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i.split("-", 1)[1]) == 32 for i in ids), "episode ids: 128 random bits"
