"""POST /v1/chat/completions: messages rendered with the model's chat template, n assistant replies out."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from frontend.choice import ChoiceDelta, ChoiceOutput
from frontend.generation import Generation
from frontend.logprobs import chat_logprobs, vllm_prompt_logprobs
from frontend.openapi import request_body
from frontend.protocol import ChatCompletionRequest, parse_body
from frontend.routes.serving import serve_job
from frontend.state import ServerState, get_state
from frontend.tokenizer import Tokenizer
from frontend.tool_parsers import ToolParser, output_stream, read_output
from frontend.tool_stream import ToolCallStream
from frontend.validation import GenerationJob, chat_job
from proto.messages import FinishReason

router = APIRouter()


class ChatFormat:
    """OpenAI's chat choices; logprobs as {"content": [{token, logprob, bytes, top_logprobs}]}.

    With tools, each choice's output goes through one reader (frontend/tool_parsers.py) that
    turns it into content and `tool_calls`; a choice that sent a call finishes with "tool_calls",
    except under a named tool_choice, where it finishes with "stop" (as OpenAI documents and vLLM
    does: the call was asked for, not chosen).
    """

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, tokenizer: Tokenizer, tool_parser: ToolParser) -> None:
        self._tokenizer = tokenizer
        self._tool_parser = tool_parser
        self._streams: dict[int, ToolCallStream | None] = {}  # per choice, made on its first delta
        self._called: set[int] = set()  # choices that have sent a tool call they chose to make

    def first_choices(self, generation: Generation) -> list[dict[str, Any]]:
        # OpenAI clients take each choice's role from its first chunk, before any content arrives.
        return [_delta(choice.index, {"role": "assistant", "content": ""}, None, None)
                for choice in generation.choices]

    def chunk_choices(self, generation: Generation, delta: ChoiceDelta) -> list[dict[str, Any]]:
        logprobs = None
        if delta.token_ids and generation.choices[delta.index].wants_logprobs:
            logprobs = chat_logprobs(self._tokenizer, delta.token_ids, delta.logprobs,
                                     generation.job.sampling_params.logprobs, generation.job.tokens_as_ids)
        deltas = self._output_deltas(generation, delta)
        if not deltas and logprobs is not None:
            deltas = [{}]  # the logprobs of tokens whose text is still held back
        return [_delta(delta.index, d, logprobs if i == 0 else None, None) for i, d in enumerate(deltas)]

    def finish_choice(self, index: int, finish_reason: FinishReason) -> dict[str, Any]:
        return _delta(index, {}, None, self._finish_reason(index in self._called, finish_reason))

    def final_choice(self, generation: Generation, choice: ChoiceOutput) -> dict[str, Any]:
        logprobs = None
        if choice.wants_logprobs:
            logprobs = chat_logprobs(self._tokenizer, choice.token_ids, choice.logprobs,
                                     generation.job.sampling_params.logprobs, generation.job.tokens_as_ids)
        parsed = read_output(generation.job.tool_choice, self._tool_parser, choice.text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        return {"index": choice.index, "message": message, "logprobs": logprobs,
                "finish_reason": self._finish_reason(bool(parsed.tool_calls) and _chose(generation),
                                                     choice.finish_reason)}

    def response_fields(self, generation: Generation) -> dict[str, Any]:
        """vLLM's prompt_logprobs (null when not asked), beside the choices: the prompt is every choice's."""
        job = generation.job
        if job.prompt_logprobs < 0:
            return {"prompt_logprobs": None}
        return {"prompt_logprobs": vllm_prompt_logprobs(self._tokenizer, job.prompt_token_ids,
                                                        generation.prompt_logprobs, job.prompt_logprobs)}

    def _output_deltas(self, generation: Generation, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """Content, or content and tool calls through the choice's reader (flushed at its end)."""
        if delta.index not in self._streams:
            self._streams[delta.index] = output_stream(generation.job.tool_choice, self._tool_parser)
        stream = self._streams[delta.index]
        if stream is None:
            return [{"content": delta.text}] if delta.text else []
        deltas = stream.feed(delta.text) if delta.text else []
        if delta.finish_reason:
            deltas += stream.finish()
        if _chose(generation) and any("tool_calls" in d for d in deltas):
            self._called.add(delta.index)
        return deltas

    @staticmethod
    def _finish_reason(called: bool, finish_reason: FinishReason) -> str:
        """OpenAI's "tool_calls" for a choice that ended on its own after making calls."""
        return "tool_calls" if called and finish_reason == FinishReason.STOP else finish_reason


def _chose(generation: Generation) -> bool:
    """Whether the model chose its tool calls (auto, required), rather than was told which (named)."""
    return generation.job.tool_choice.mode != "named"


def _delta(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
           finish_reason: FinishReason | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def create_chat_completion(request: Request) -> Response:
    arrival_s = time.monotonic()
    state = get_state(request)
    raw = await request.body()
    job = await state.prepare(lambda: _prepare(raw, state))
    return await serve_job(state, request, [job], lambda: ChatFormat(state.tokenizer, state.tool_parser),
                           arrival_s)


def _prepare(raw: bytes, state: ServerState) -> GenerationJob:
    body = parse_body(raw, ChatCompletionRequest)
    state.check_model(body.model)
    return chat_job(body, state.tokenizer, state.limits, state.grammar_checker)
