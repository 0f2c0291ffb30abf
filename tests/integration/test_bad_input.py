"""Every bad input gets an OpenAI error body with the right status, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from deploy.launcher import Stack

LONG_PROMPT = "fox " * 700

CASES = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 2.0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 1000}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": LONG_PROMPT}, 400, None),
    ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "top_k": -5}, 400, "top_k"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
     404, "model"),
]


@pytest.mark.parametrize("path, body, status, param", CASES)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(
        stack: Stack, path: str, body: object, status: int, param: str | None) -> None:
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{stack.url}{path}", timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    ok = httpx.post(f"{stack.url}/v1/completions", timeout=30,
                    json={"model": "tiny", "prompt": "still there?", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_over_long_prompt_error_names_the_limit_and_the_count(stack: Stack) -> None:
    response = httpx.post(f"{stack.url}/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 4})
    assert response.status_code == 400
    count = httpx.post(f"{stack.url}/tokenize", json={"prompt": LONG_PROMPT}, timeout=10).json()["count"]
    message = response.json()["error"]["message"]
    assert "512" in message and str(count) in message, message
