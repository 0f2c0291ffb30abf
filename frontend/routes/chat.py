"""POST /v1/chat/completions: messages rendered with the model's chat template, n assistant replies out."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from frontend.choice import ChoiceDelta, ChoiceOutput
from frontend.generation import Generation
from frontend.logprobs import chat_logprobs
from frontend.openapi import request_body
from frontend.protocol import ChatCompletionRequest, parse_body
from frontend.routes.serving import serve_job
from frontend.state import ServerState, get_state
from frontend.tokenizer import Tokenizer
from frontend.validation import GenerationJob, chat_job
from proto.messages import FinishReason

router = APIRouter()


class ChatFormat:
    """OpenAI's chat choices; logprobs as {"content": [{token, logprob, bytes, top_logprobs}]}."""

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def first_choices(self, generation: Generation) -> list[dict[str, Any]]:
        # OpenAI clients take each choice's role from its first chunk, before any content arrives.
        return [_delta(choice.index, {"role": "assistant", "content": ""}, None, None)
                for choice in generation.choices]

    def chunk_choice(self, generation: Generation, delta: ChoiceDelta) -> dict[str, Any] | None:
        logprobs = None
        if delta.token_ids and generation.choices[delta.index].wants_logprobs:
            logprobs = chat_logprobs(self._tokenizer, delta.token_ids, delta.logprobs,
                                     generation.job.sampling_params.logprobs)
        if not delta.text and logprobs is None:
            return None
        return _delta(delta.index, {"content": delta.text} if delta.text else {}, logprobs, None)

    def finish_choice(self, index: int, finish_reason: FinishReason) -> dict[str, Any]:
        return _delta(index, {}, None, finish_reason)

    def final_choice(self, generation: Generation, choice: ChoiceOutput) -> dict[str, Any]:
        logprobs = None
        if choice.wants_logprobs:
            logprobs = chat_logprobs(self._tokenizer, choice.token_ids, choice.logprobs,
                                     generation.job.sampling_params.logprobs)
        return {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": logprobs, "finish_reason": choice.finish_reason}


def _delta(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
           finish_reason: FinishReason | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def create_chat_completion(request: Request) -> Response:
    arrival_s = time.monotonic()
    state = get_state(request)
    raw = await request.body()
    job = await state.prepare(lambda: _prepare(raw, state))
    return await serve_job(state, request, job, ChatFormat(state.tokenizer), arrival_s)


def _prepare(raw: bytes, state: ServerState) -> GenerationJob:
    body = parse_body(raw, ChatCompletionRequest)
    state.check_model(body.model)
    return chat_job(body, state.tokenizer, state.limits)
