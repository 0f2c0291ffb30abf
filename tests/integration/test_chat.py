"""Chat through the whole stack: the template's own prompt, greedy text and logprobs against HF, streaming."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from support import hf_greedy_logprobs, sse_events

from deploy.launcher import Stack
from frontend.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And the quick brown fox?"}]
MAX_TOKENS = 8
TOP_LOGPROBS = 2


@pytest.fixture(scope="module")
def template_prompt_ids(tiny_model_dir: Path) -> list[int]:
    """MESSAGES rendered and tokenized by transformers' apply_chat_template, not by conveyor."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


@pytest.fixture(scope="module")
def hf_reply(tiny_model_dir: Path, template_prompt_ids: list[int]) -> tuple[str, list[int], torch.Tensor]:
    """HF's greedy reply to the template's prompt: its text, token ids and log_softmax rows."""
    from transformers import AutoTokenizer

    generated, logprobs = hf_greedy_logprobs(tiny_model_dir, template_prompt_ids, MAX_TOKENS)
    text = AutoTokenizer.from_pretrained(tiny_model_dir).decode(generated, skip_special_tokens=True)
    return text, generated, logprobs


def chat(stack: Stack, **fields: object) -> dict:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, **fields}
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_prompt_is_the_chat_templates_own_rendering(
        stack: Stack, template_prompt_ids: list[int]) -> None:
    rendered = httpx.post(f"{stack.url}/tokenize", json={"model": "tiny", "messages": MESSAGES},
                          timeout=10).json()
    assert rendered["tokens"] == template_prompt_ids
    assert chat(stack)["usage"]["prompt_tokens"] == len(template_prompt_ids)


def test_greedy_chat_reply_equals_hf_generate_on_the_templates_prompt(
        stack: Stack, hf_reply: tuple[str, list[int], torch.Tensor]) -> None:
    body = chat(stack)
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": hf_reply[0]}
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == MAX_TOKENS


def test_chat_logprobs_equal_hf_log_softmax(
        stack: Stack, tiny_model_dir: Path, template_prompt_ids: list[int],
        hf_reply: tuple[str, list[int], torch.Tensor]) -> None:
    _, generated, hf = hf_reply
    text_of = Tokenizer.from_dir(tiny_model_dir).token_text
    content = chat(stack, logprobs=True, top_logprobs=TOP_LOGPROBS)["choices"][0]["logprobs"]["content"]
    assert [item["token"] for item in content] == [text_of(token_id) for token_id in generated]
    for step, (item, token_id) in enumerate(zip(content, generated)):
        row = hf[len(template_prompt_ids) - 1 + step]
        assert item["logprob"] == pytest.approx(float(row[token_id]), abs=1e-4)
        values, ids = row.topk(TOP_LOGPROBS)
        assert [top["token"] for top in item["top_logprobs"]] == [text_of(int(i)) for i in ids]
        assert [top["logprob"] for top in item["top_logprobs"]] == pytest.approx(values.tolist(), abs=1e-4)


def test_streamed_chat_is_sse_with_the_reply_a_usage_chunk_and_done(
        stack: Stack, template_prompt_ids: list[int], hf_reply: tuple[str, list[int], torch.Tensor]) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(response.iter_lines()))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    *chunks, usage_chunk = events[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == hf_reply[0]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] \
        == ["length"]
    usage = usage_chunk["usage"]
    assert usage_chunk["choices"] == []
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) \
        == (len(template_prompt_ids), MAX_TOKENS, len(template_prompt_ids) + MAX_TOKENS)
