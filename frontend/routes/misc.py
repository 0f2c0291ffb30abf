"""The small endpoints: models, health, metrics, tokenize, detokenize, version."""

from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from frontend.errors import bad_request
from frontend.openapi import request_body
from frontend.protocol import DetokenizeRequest, TokenizeRequest, parse_body
from frontend.state import ServerState, get_state
from frontend.tools import parse_tools
from frontend.prompt_text import chat_prompt_ids, check_text_fits
from frontend.validation import check_token_ids

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(get_state(request))]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> dict:
    """OpenAI's model retrieval (the `openai` client's models.retrieve); 404 for another name."""
    state = get_state(request)
    state.check_model(model)
    return _model_card(state)


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created_s,
            "owned_by": "conveyor", "root": state.config.model,
            "max_model_len": state.limits.max_model_len}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 only while the scheduler makes progress: a step or an idle heartbeat was RECEIVED within
    the engine client's alive timeout (our clock) and no step's ranks have been idle for
    --stall-timeout (scheduler_proc.rank_progress). A hung
    or dead scheduler, hung workers, a frontend that has not heard from it yet, or a draining one:
    503."""
    state = get_state(request)
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if getattr(state.engine, "recovering", False):  # a replaced scheduler is taking over
        return JSONResponse({"status": "recovering"}, status_code=503)
    if not state.engine.is_alive():
        status = "starting" if state.engine.latest_stats is None else "engine_unavailable"
        return JSONResponse({"status": status}, status_code=503)
    stats = state.engine.latest_stats  # None from an engine alive before any message (the tests' fake)
    if stats is not None and not stats.workers_serving:  # a lost worker group is being replaced
        return JSONResponse({"status": "recovering"}, status_code=503)
    # Hung workers: a step whose ranks have computed nothing for --stall-timeout (a long step that
    # computes is not one; --step-timeout bounds it). Replaced at --step-timeout.
    if stats is not None and stats.step_idle_s >= state.config.stall_timeout_s:
        return JSONResponse({"status": "stalled", "step_running_s": round(stats.step_running_s, 1),
                             "step_idle_s": round(stats.step_idle_s, 1)}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ping")
@router.post("/ping")
async def ping(request: Request) -> JSONResponse:
    """vLLM's /ping (the health check of SageMaker-style hosts, GET or POST): /health's answer."""
    return await health(request)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = get_state(request)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
async def tokenize(request: Request) -> dict:
    state = get_state(request)
    raw = await request.body()
    return await state.prepare(lambda: _tokenize(parse_body(raw, TokenizeRequest), state))


def _tokenize(body: TokenizeRequest, state: ServerState) -> dict:
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of `prompt` or `messages`")
    max_model_len = state.limits.max_model_len
    if body.tools is not None and body.messages is None:
        raise bad_request("tools are rendered into a chat prompt: send them with `messages`", "tools")
    if body.messages is not None:
        tools = parse_tools(body.tools, None)  # the shape only: rendering compiles no grammar
        tokens = chat_prompt_ids(body.messages, state.tokenizer, body, max_model_len, tools)
    else:
        check_text_fits(body.prompt, state.tokenizer, max_model_len, "prompt")
        tokens = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    response = {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}
    if body.return_token_strs:
        response["token_strs"] = [state.tokenizer.token_piece(token) for token in tokens]
    return response


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
async def detokenize(request: Request) -> dict:
    state = get_state(request)
    raw = await request.body()
    return await state.prepare(lambda: _detokenize(parse_body(raw, DetokenizeRequest), state))


def _detokenize(body: DetokenizeRequest, state: ServerState) -> dict:
    state.check_model(body.model)
    check_token_ids(body.tokens, state.tokenizer.vocab_size, "tokens")
    return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}


@router.get("/version")
async def version(request: Request) -> dict:
    """conveyor's version and what the workers compute in, with the supervisor's reason."""
    config = get_state(request).config
    try:
        number = metadata.version("conveyor")
    except metadata.PackageNotFoundError:
        number = "unknown"
    return {"version": number, "dtype": config.dtype, "dtype_reason": config.dtype_reason,
            "kv_cache_dtype": config.kv_dtype,
            "cpu_isa_cap": config.cpu_isa or None}
