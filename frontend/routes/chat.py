"""POST /v1/chat/completions: messages rendered with the model's chat template, an assistant reply out."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from frontend.protocol import ChatCompletionRequest, parse_body
from frontend.routes.serving import serve_job
from frontend.state import get_state
from frontend.validation import chat_job

router = APIRouter()


class ChatFormat:
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def first_choice(self) -> dict[str, Any] | None:
        # OpenAI clients take the role from the first chunk, before any content arrives.
        return self._delta({"role": "assistant", "content": ""}, None)

    def chunk_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return self._delta({"content": text} if text else {}, finish_reason)

    def final_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def _delta(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    arrival_s = time.monotonic()
    state = get_state(request)
    body = parse_body(await request.body(), ChatCompletionRequest)
    state.check_model(body.model)
    job = chat_job(body, state.tokenizer, state.limits)
    return await serve_job(state, request, job, ChatFormat(), arrival_s)
