"""Admission checks: why a new request can never run (or may not queue), with the limit and the value."""

from __future__ import annotations

import numpy as np

from proto.config import EngineConfig, beyond_free_seats, prompt_fits
from proto.errors import ValidationError
from proto.messages import (ERROR_INVALID_REQUEST, ERROR_NONE, ERROR_QUEUE_FULL, ERROR_WAITING_TOKENS_FULL,
                            AddRequest)
from scheduler_proc.block_manager import blocks_for_tokens
from scheduler_proc.request import max_num_kv_tokens
from scheduler_proc.stop import stop_token_set


def rejection_reason(message: AddRequest, config: EngineConfig, num_kv_blocks: int,
                     num_waiting: int, num_waiting_tokens: int, num_free_seats: int = 0) -> tuple[str, int]:
    """("", ERROR_NONE) if the request may queue; otherwise the error message it finishes with and
    its ERROR_* code: ERROR_QUEUE_FULL / ERROR_WAITING_TOKENS_FULL for a queue full by count or
    by prompt tokens (it may succeed later, the frontend answers 429), ERROR_INVALID_REQUEST for
    a request that can never run as asked (400).

    Rejecting here, rather than letting it wait, is what keeps an impossible request from
    waiting forever: such a request would never fit, however long the others take. An empty
    queue takes any request that can run, so none is refused by the queue bounds forever. The
    sequences that the free seats (`num_free_seats`: max_num_seqs less those running) take at the
    next step do not count against max_num_waiting: a burst to an idle server fills its seats and
    then its queue, max_num_seqs + max_num_waiting sequences in all.
    A resubmission to a replaced scheduler (AddRequest.resume) was admitted once already: the
    queue limits do not refuse it, and a refusal is the server's error (ERROR_NONE), not the
    client's.
    """
    if message.resume is not None:  # its client sent a valid request long ago: not a 400 now
        return _never_runs_reason(message, config, num_kv_blocks), ERROR_NONE
    num_choices = message.sampling_params.n  # each choice waits as a sequence of its own
    if num_waiting and num_waiting + num_choices > config.max_num_waiting + num_free_seats:
        return (f"the waiting queue is full: {num_waiting} sequences are waiting, this request adds "
                f"{num_choices} and max_num_waiting is {config.max_num_waiting} "
                f"{beyond_free_seats(num_free_seats)}"), ERROR_QUEUE_FULL
    num_prompt = len(message.prompt_token_ids)
    if num_waiting and num_waiting_tokens + num_prompt > config.max_waiting_tokens:
        return (f"the waiting queue is full: {num_waiting_tokens} prompt tokens are waiting, this "
                f"request adds {num_prompt} and max_waiting_tokens is {config.max_waiting_tokens}"
                ), ERROR_WAITING_TOKENS_FULL
    return _never_runs(message, config, num_kv_blocks)


def _never_runs(message: AddRequest, config: EngineConfig, num_kv_blocks: int) -> tuple[str, int]:
    reason = _never_runs_reason(message, config, num_kv_blocks)
    return reason, ERROR_INVALID_REQUEST if reason else ERROR_NONE


def _never_runs_reason(message: AddRequest, config: EngineConfig, num_kv_blocks: int) -> str:
    prompt = message.prompt_token_ids
    num_prompt = len(prompt)
    if config.max_model_len and not prompt_fits(num_prompt, config.max_model_len):
        return (f"the prompt has {num_prompt} tokens but max_model_len is {config.max_model_len}: "
                f"no room for a generated token")
    if config.vocab_size and int(prompt.max()) >= config.vocab_size:
        return (f"prompt token id {int(prompt.max())} is out of range for a vocabulary of "
                f"{config.vocab_size}")
    if message.sampling_params.allowed_token_ids:
        empty = _empty_allowed_set_reason(message, config)
        if empty:
            return empty
    if message.resume is not None:
        resume_error = _resume_error(message, config)
        if resume_error:
            return resume_error
    if config.vocab_size:  # the decoder validated the rest; it cannot know the vocabulary
        try:
            message.sampling_params.check_vocab(config.vocab_size)
        except ValidationError as exc:
            return exc.message
    return _kv_capacity_error(num_prompt, message.sampling_params.max_tokens, config, num_kv_blocks)


def _empty_allowed_set_reason(message: AddRequest, config: EngineConfig) -> str:
    """allowed_token_ids that leave nothing to sample: all banned as one-token bad_words, or all
    stop tokens while min_tokens forbids stopping."""
    params = message.sampling_params
    allowed = set(params.allowed_token_ids) - {t[0] for t in params.bad_words_token_ids if len(t) == 1}
    if not allowed:
        return "every one of allowed_token_ids is also one of bad_words: no token is left to sample"
    if params.min_tokens and allowed <= stop_token_set(params, config.eos_token_ids):
        return (f"allowed_token_ids holds only stop tokens, which min_tokens {params.min_tokens} forbids "
                f"at first: no token is left to sample")
    return ""


def _resume_error(message: AddRequest, config: EngineConfig) -> str:
    """Resumed output tokens the model could not have made, or so many that the choice would
    have finished (the frontend never resubmits such a choice)."""
    resume, num_prompt = message.resume, len(message.prompt_token_ids)
    token_ids = resume.token_ids
    if config.vocab_size and len(token_ids) and int(token_ids.max()) >= config.vocab_size:
        return (f"resumed output token id {int(token_ids.max())} is out of range for a vocabulary "
                f"of {config.vocab_size}")
    max_outputs = max_num_kv_tokens(num_prompt, message.sampling_params.max_tokens, config.max_model_len) \
        + 1 - num_prompt
    lengths = np.diff(resume.cu_token_ids)[~resume.finished]  # int32 [num_unfinished]
    if len(lengths) and int(lengths.max()) >= max_outputs:
        return (f"a resumed choice has {int(lengths.max())} output tokens; at most {max_outputs - 1} "
                f"can precede another one (max_tokens and max_model_len)")
    return ""


def _kv_capacity_error(num_prompt: int, max_tokens: int, config: EngineConfig, num_kv_blocks: int) -> str:
    num_kv_tokens = max_num_kv_tokens(num_prompt, max_tokens, config.max_model_len)
    needed_blocks = blocks_for_tokens(num_kv_tokens, config.block_size)
    if needed_blocks <= num_kv_blocks:
        return ""
    capacity = num_kv_blocks * config.block_size
    return (f"the request needs up to {num_kv_tokens} tokens of KV cache ({num_prompt} prompt + "
            f"{max_tokens} max_tokens - 1, capped by max_model_len) = {needed_blocks} blocks, but the "
            f"whole KV cache holds {num_kv_blocks} blocks of {config.block_size} tokens "
            f"({capacity} tokens); lower max_tokens or shorten the prompt")


def startup_capacity_error(config: EngineConfig, num_kv_blocks: int) -> str:
    """Why the workers' KV cache cannot serve config.max_model_len, or "": one sequence at the
    longest context must fit the whole cache, else requests the frontend accepts would be refused
    (or a chat request without max_tokens, which may run to max_model_len, never served)."""
    if not config.max_model_len:
        return ""
    needed_blocks = blocks_for_tokens(config.max_model_len - 1, config.block_size)
    if needed_blocks <= num_kv_blocks:
        return ""
    capacity = num_kv_blocks * config.block_size
    return (f"max_model_len {config.max_model_len} needs {needed_blocks} KV blocks of {config.block_size} "
            f"tokens for one sequence, but the workers' KV cache holds {num_kv_blocks} blocks ({capacity} "
            f"tokens): pass --max-model-len {capacity} or less, or give the KV cache more room "
            f"(--kv-cache-memory on a CPU, --gpu-memory-utilization on a GPU, or --num-kv-blocks)")
