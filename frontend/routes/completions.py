"""POST /v1/completions: a text (or token id) prompt in, a text completion out."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from frontend.protocol import CompletionRequest, parse_body
from frontend.routes.serving import serve_job
from frontend.state import get_state
from frontend.validation import completion_job

router = APIRouter()


class CompletionFormat:
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def first_choice(self) -> dict[str, Any] | None:
        return None

    def chunk_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def final_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        return self.chunk_choice(text, finish_reason)


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    arrival_s = time.monotonic()
    state = get_state(request)
    body = parse_body(await request.body(), CompletionRequest)
    state.check_model(body.model)
    job = completion_job(body, state.tokenizer, state.limits)
    return await serve_job(state, request, job, CompletionFormat(), arrival_s)
