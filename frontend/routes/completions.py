"""POST /v1/completions: a text (or token id) prompt in, n text completions out."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from frontend.choice import ChoiceDelta, ChoiceOutput
from frontend.generation import Generation
from frontend.logprobs import CompletionLogprobs, prompt_entries, vllm_prompt_logprobs
from frontend.openapi import request_body
from frontend.protocol import CompletionRequest, parse_body
from frontend.routes.serving import serve_job
from frontend.state import ServerState, get_state
from frontend.tokenizer import Tokenizer
from frontend.validation import GenerationJob, check_batch_fits, completion_jobs
from proto.messages import FinishReason

router = APIRouter()


class CompletionFormat:
    """OpenAI's legacy completion choices; logprobs in the {tokens, token_logprobs, ...} shape."""

    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream_logprobs: dict[int, CompletionLogprobs] = {}  # per choice: running text_offset
        self._echoed: set[int] = set()  # streamed choices whose first chunk carried the prompt
        self._echo_only = False

    def first_choices(self, generation: Generation) -> list[dict[str, Any]]:
        return []

    def chunk_choices(self, generation: Generation, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """With echo, a choice's first chunk starts with the prompt (and its logprobs), as vLLM
        streams it; with echo_only that chunk is all there is (the sampled token is not shown)."""
        job = generation.job
        self._echo_only = job.echo_only
        text, token_ids, entries = ("", [], []) if job.echo_only else (delta.text, delta.token_ids, delta.logprobs)
        if job.echo_text is not None and delta.index not in self._echoed and delta.token_ids:  # not a failure
            self._echoed.add(delta.index)
            text = job.echo_text + text
            token_ids = [*job.prompt_token_ids, *token_ids]
            entries = [*prompt_entries(job.prompt_token_ids, generation.prompt_logprobs,
                                       job.sampling_params.logprobs), *entries]
        logprobs = None
        if token_ids and generation.choices[delta.index].wants_logprobs:
            builder = self._stream_logprobs.setdefault(delta.index, CompletionLogprobs(self._tokenizer,
                                                                                       job.tokens_as_ids))
            logprobs = builder.build(token_ids, entries)
        if not text and logprobs is None:
            return []
        return [_choice(delta.index, text, logprobs, None)]

    def finish_choice(self, index: int, finish_reason: FinishReason) -> dict[str, Any]:
        """echo_only ends by "length" (its max_tokens, 0, reached), as its final_choice does."""
        return _choice(index, "", None, FinishReason.LENGTH if self._echo_only else finish_reason)

    def final_choice(self, generation: Generation, choice: ChoiceOutput) -> dict[str, Any]:
        """The choice's text and tokens after the echoed prompt; with echo_only the prompt alone,
        ended by "length" (its max_tokens, 0, reached), whatever the one token sampled after it."""
        job = generation.job
        echo_text, output_text = job.echo_text, "" if job.echo_only else choice.text
        text = output_text if echo_text is None else echo_text + output_text
        finish_reason = FinishReason.LENGTH if job.echo_only else choice.finish_reason
        logprobs = None
        if choice.wants_logprobs:
            token_ids, entries = ([], []) if job.echo_only else (list(choice.token_ids), list(choice.logprobs))
            if echo_text is not None:
                prompt_ids = generation.job.prompt_token_ids
                token_ids[:0] = prompt_ids
                entries[:0] = prompt_entries(prompt_ids, generation.prompt_logprobs, job.sampling_params.logprobs)
            logprobs = CompletionLogprobs(self._tokenizer, job.tokens_as_ids).build(token_ids, entries)
        final = _choice(choice.index, text, logprobs, finish_reason)
        # vLLM's field, null when not asked: every choice of the prompt carries the prompt's
        final["prompt_logprobs"] = None if job.prompt_logprobs < 0 else vllm_prompt_logprobs(
            self._tokenizer, job.prompt_token_ids, generation.prompt_logprobs, job.prompt_logprobs)
        return final

    def response_fields(self, generation: Generation) -> dict[str, Any]:
        return {}


def _choice(index: int, text: str, logprobs: dict[str, Any] | None,
            finish_reason: FinishReason | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
async def create_completion(request: Request) -> Response:
    arrival_s = time.monotonic()
    state = get_state(request)
    raw = await request.body()
    jobs = await state.prepare(lambda: _prepare(raw, state))
    return await serve_job(state, request, jobs, lambda: CompletionFormat(state.tokenizer), arrival_s)


def _prepare(raw: bytes, state: ServerState) -> list[GenerationJob]:
    body = parse_body(raw, CompletionRequest)
    state.check_model(body.model)
    jobs = completion_jobs(body, state.tokenizer, state.limits, state.grammar_checker)
    config = state.config
    check_batch_fits(jobs, config.max_num_seqs, config.max_num_waiting, config.max_waiting_tokens)
    return jobs
