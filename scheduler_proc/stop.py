"""Stop checks on token ids, and the logit adjustments that keep stop tokens out before min_tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from proto.messages import FinishReason
from proto.sampling import SamplingParams

if TYPE_CHECKING:
    from scheduler_proc.request import Request


@dataclass(frozen=True)
class BiasTriples:
    """One request's sparse logit adjustments (token, value); the plan adds the row index."""

    token_ids: np.ndarray  # int32 [num_biases]
    values: np.ndarray  # float32 [num_biases]


def stop_token_set(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """Token ids that end the request: its stop_token_ids, plus the model's EOS unless ignore_eos."""
    eos = () if params.ignore_eos else eos_token_ids
    return frozenset(params.stop_token_ids) | frozenset(eos)


def logit_biases(params: SamplingParams, stop_token_ids: frozenset[int]) -> tuple[BiasTriples, BiasTriples]:
    """(after min_tokens, before min_tokens): the client's logit_bias, then the same with every
    stop token at -inf. Each token appears once per row, so the worker may assign or add."""
    merged = dict(params.logit_bias)
    plain = _triples(merged)
    if params.min_tokens == 0:
        return plain, plain
    merged.update((token_id, float("-inf")) for token_id in stop_token_ids)
    return plain, _triples(merged)


def active_bias(request: Request) -> BiasTriples:
    """The adjustments for the token about to be sampled (output number num_output_tokens + 1)."""
    if request.num_output_tokens < request.sampling_params.min_tokens:
        return request.min_tokens_logit_bias
    return request.logit_bias


def stop_reason(request: Request) -> FinishReason:
    """Finish reason after a token was appended (NONE = keep going): the stop rule, written here only.

    A stop token ends the request only once more than min_tokens tokens exist (the first
    min_tokens may not be stop tokens; the worker masks them, and a worker that did not is not
    obeyed). A stop token wins over a simultaneous length limit: the model did end by itself.
    The length limit is max_tokens outputs, or max_model_len tokens once one output exists
    (Request.max_num_kv_tokens + 1 tokens either way).
    Structured output: a token the grammar rejected (or a failed mask) is an "error"; a grammar
    that can only end (is_finished) stops with "stop", even under ignore_eos; EOS is no special
    case, the mask allows it only where the grammar accepts.
    """
    num_tokens, grammar = request.num_tokens, request.grammar
    if grammar is not None and grammar.error:
        return FinishReason.ERROR
    if (request.last_token_id in request.stop_token_ids
            and num_tokens - request.num_prompt_tokens > request.sampling_params.min_tokens):
        return FinishReason.STOP
    if grammar is not None and grammar.is_finished:
        return FinishReason.STOP
    return FinishReason.LENGTH if num_tokens > request.max_num_kv_tokens else FinishReason.NONE


def _triples(bias: dict[int, float]) -> BiasTriples:
    token_ids = np.fromiter(bias.keys(), dtype=np.int32, count=len(bias))
    values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
    return BiasTriples(token_ids, values)
