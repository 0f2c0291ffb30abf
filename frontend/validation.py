"""Request validation: parsed OpenAI requests -> a GenerationJob (prompt ids, SamplingParams, stops)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from frontend.errors import APIError, bad_request
from frontend.grammar_check import GrammarCheck
from frontend.prompt_text import chat_prompt_ids, check_text_fits
from frontend.sampling_fields import bad_words_token_ids, or_default, sampling_params, stop_strings
from frontend.protocol import MAX_BATCH_SEQUENCES, ChatCompletionRequest, CompletionRequest, SamplingFields
from frontend.structured_output import request_grammar
from frontend.tokenizer import Tokenizer
from frontend.tools import ToolChoice, parse_tool_choice, parse_tools, tool_choice_grammar
from frontend.unsupported_fields import UNSUPPORTED_CHAT_FIELDS, UNSUPPORTED_FIELDS, refuse_unsupported
from proto.config import prompt_fits
from proto.grammar import GrammarSpec
from proto.sampling import DEFAULTS, MAX_LOGPROBS, MAX_N, SamplingParams

@dataclass(frozen=True)
class ModelLimits:
    """The model facts requests are checked against, as the supervisor resolved them."""

    max_model_len: int
    vocab_size: int  # the model's (may exceed the tokenizer's): bounds token ids in requests

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.vocab_size < 1:
            raise ValueError(f"max_model_len {self.max_model_len} and vocab_size {self.vocab_size} "
                             f"must be resolved (>= 1) before the frontend starts: the supervisor "
                             f"fills them in from the model")


@dataclass(frozen=True)
class GenerationJob:
    """Everything the frontend needs to run one validated request."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # n choices; logprobs / prompt_logprobs -1 when not asked
    stop: list[str]
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # stream: every chunk carries the usage so far (vLLM's stream option)
    skip_special_tokens: bool = True  # False: special tokens' text is part of the output text
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's return_tokens_as_token_ids)
    include_stop_str: bool = False  # the stop string or stop token that ended a choice stays in its text
    echo_text: str | None = None  # completions with echo: the prompt text each choice starts with
    echo_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs) alone, nothing generated
    prompt_logprobs: int = -1  # vLLM's prompt_logprobs: each prompt token's entry with the top k (-1: not asked)
    grammar: GrammarSpec | None = None  # the output constraint (AddRequest.grammar), compile-checked
    tool_choice: ToolChoice = ToolChoice("none")  # chat: how tool calls are read from the output


def completion_jobs(request: CompletionRequest, tokenizer: Tokenizer, limits: ModelLimits,
                    checker: GrammarCheck | None = None) -> list[GenerationJob]:
    """One job per prompt (a string, a list of token ids, or a batch of either: OpenAI's shapes).
    `logprobs=k`: each token's logprob and the top k; with `echo`, the prompt's tokens too. An
    output constraint is compile-checked by `checker` (skipped without one), once for all prompts."""
    grammar = _check_choices(request, checker)
    if request.suffix:
        raise bad_request("suffix is not supported", "suffix")
    logprobs = _check_num_logprobs(request.logprobs, "logprobs")
    prompt_logprobs = _check_prompt_logprobs(request)
    # Scoring a prompt (OpenAI's and vLLM's echo with max_tokens 0): the engine computes it and
    # samples one token as always; the response leaves that token out.
    echo_only = bool(request.echo) and request.max_tokens == 0
    if request.max_tokens == 0 and not echo_only:
        raise bad_request("max_tokens must be >= 1, got 0 (0 only with echo: the prompt scored, nothing "
                          "generated)", "max_tokens")
    if echo_only and request.min_tokens:
        raise bad_request(f"min_tokens must be 0 when max_tokens is 0 (echo only scores the prompt), got "
                          f"{request.min_tokens}", "min_tokens")
    prompts = _prompts(request.prompt, or_default(request.n, DEFAULTS.n))
    bad_words = bad_words_token_ids(request.bad_words, tokenizer)  # once for every prompt
    jobs = []
    for index, prompt in enumerate(prompts):
        try:  # what is wrong with one prompt of a batch says which
            prompt_ids = completion_prompt_ids(prompt, tokenizer, limits,
                                               truncating=request.truncate_prompt_tokens is not None)
            kept = _truncated(prompt_ids, request.truncate_prompt_tokens, limits, request.max_tokens)
            if len(kept) < len(prompt_ids):
                prompt = prompt_ids = kept  # echo shows what the model was given
            room = _check_prompt_fits(prompt_ids, request.max_tokens, limits, "prompt")
        except APIError as exc:
            if len(prompts) > 1:
                exc.message = f"prompt {index}: {exc.message}"
            raise
        jobs.append(_completion_job(request, prompt, prompt_ids, room, tokenizer, limits, logprobs,
                                    prompt_logprobs, grammar, echo_only, bad_words))
    return jobs


def check_batch_fits(jobs: list[GenerationJob], max_num_seqs: int, max_num_waiting: int,
                     max_waiting_tokens: int) -> None:
    """A batch runs as one scheduler request per prompt, all queued at once: one the scheduler can
    never hold at once would be refused (429) at every try, so it is a 400 naming the limits."""
    if len(jobs) < 2:
        return
    num_sequences = sum(job.sampling_params.n for job in jobs)
    if num_sequences > max_num_seqs + max_num_waiting:
        raise bad_request(f"this batch of prompts asks for {num_sequences} sequences (prompts x n); this "
                          f"server holds at most {max_num_seqs + max_num_waiting} at once (--max-num-seqs "
                          f"{max_num_seqs} + --max-num-waiting {max_num_waiting})", "prompt")
    num_tokens = sum(len(job.prompt_token_ids) for job in jobs)
    if num_tokens > max_waiting_tokens:
        raise bad_request(f"this batch of prompts has {num_tokens} prompt tokens; this server queues at "
                          f"most {max_waiting_tokens} at once (--max-waiting-tokens)", "prompt")


def _completion_job(request: CompletionRequest, prompt: Any, prompt_ids: list[int], room: int, tokenizer: Tokenizer,
                    limits: ModelLimits, logprobs: int, prompt_logprobs: int, grammar: GrammarSpec | None,
                    echo_only: bool, bad_words: tuple[tuple[int, ...], ...]) -> GenerationJob:
    """The prompt's entries serve echo's logprobs and prompt_logprobs alike: the more alternatives
    of the two are computed, and each shows its own number. As in vLLM, echo with logprobs k and no
    prompt_logprobs also gives each choice prompt_logprobs with the top k."""
    default_max_tokens = min(DEFAULTS.max_tokens, room)
    echo_text = _echo_text(prompt, prompt_ids, tokenizer) if request.echo else None
    echo_logprobs = logprobs if request.echo else -1
    logprob_fields = {"logprobs": logprobs, "prompt_logprobs": max(echo_logprobs, prompt_logprobs)}
    max_tokens = 1 if echo_only else or_default(request.max_tokens, default_max_tokens)
    job = _job(request, prompt_ids, max_tokens, limits, logprob_fields, echo_text, grammar, bad_words=bad_words,
               prompt_logprobs=prompt_logprobs if prompt_logprobs >= 0 else echo_logprobs)
    return dataclasses.replace(job, echo_only=True) if echo_only else job


def chat_job(request: ChatCompletionRequest, tokenizer: Tokenizer, limits: ModelLimits,
             checker: GrammarCheck | None = None) -> GenerationJob:
    """`logprobs: true`: each token's logprob, plus the top `top_logprobs` alternatives. `tools`
    reach the prompt; a forced `tool_choice` (required, named) is the output's grammar."""
    refuse_unsupported(request, UNSUPPORTED_CHAT_FIELDS)
    grammar = _check_choices(request, checker)
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    top_logprobs = _check_num_logprobs(request.top_logprobs, "top_logprobs")
    tools = parse_tools(request.tools, checker)
    tool_choice = dataclasses.replace(parse_tool_choice(request.tool_choice, tools),
                                      parallel=request.parallel_tool_calls is not False)
    forced = tool_choice_grammar(tool_choice, tools)
    if forced is not None:
        if grammar is not None:
            raise bad_request(f"tool_choice {tool_choice.mode!r} forces a tool call, which is itself "
                              "the output's format: leave out the other output constraint",
                              "tool_choice")
        if checker is not None:
            checker.check(forced, "tool_choice")
        grammar = forced
    truncating = request.truncate_prompt_tokens is not None
    prompt_ids = chat_prompt_ids(request.messages, tokenizer, request, None if truncating else limits.max_model_len,
                                 tools)
    max_tokens = or_default(request.max_completion_tokens, request.max_tokens)
    max_tokens_param = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_tokens_param} must be >= 1, got {max_tokens}", max_tokens_param)
    prompt_ids = _truncated(prompt_ids, request.truncate_prompt_tokens, limits, max_tokens)
    room = _check_prompt_fits(prompt_ids, max_tokens, limits, "messages", max_tokens_param)
    logprobs = max(top_logprobs, 0) if request.logprobs else -1
    prompt_logprobs = _check_prompt_logprobs(request)
    logprob_fields = {"logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
    return _job(request, prompt_ids, or_default(max_tokens, room), limits, logprob_fields, grammar=grammar,
                tool_choice=tool_choice, bad_words=bad_words_token_ids(request.bad_words, tokenizer),
                prompt_logprobs=prompt_logprobs)


def _prompts(prompt: Any, n: int) -> list[Any]:
    """The prompts of a batch (a list of strings, or of token id lists), else [prompt]; a batch of
    at most MAX_BATCH_SEQUENCES sequences in all (n each)."""
    if not (isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)):
        return [prompt]
    if len(prompt) * n > MAX_BATCH_SEQUENCES:
        raise bad_request(f"a batch of prompts may ask for at most {MAX_BATCH_SEQUENCES} sequences "
                          f"(prompts x n), got {len(prompt)} x {n}", "prompt")
    return prompt


def completion_prompt_ids(prompt: Any, tokenizer: Tokenizer, limits: ModelLimits,
                          truncating: bool = False) -> list[int]:
    """A string or a list of token ids (one prompt of a batch, `_prompts`). A prompt too long for
    the model is refused before its tokens are made or checked one by one, unless it is to be
    truncated (then only the request body's size bounds it)."""
    if isinstance(prompt, str):
        if not truncating:
            check_text_fits(prompt, tokenizer, limits.max_model_len, "prompt")
        token_ids = tokenizer.encode(prompt) if prompt else []
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        token_ids = prompt
        if not truncating:
            _check_prompt_fits(token_ids, None, limits, "prompt")
        check_token_ids(token_ids, limits.vocab_size, "prompt")
    elif prompt is None:
        raise bad_request("prompt is required", "prompt")
    else:
        raise bad_request("prompt must be a string or a list of token ids", "prompt")
    if not token_ids:
        raise bad_request("prompt must not be empty", "prompt")
    return token_ids


def _check_choices(request: SamplingFields, checker: GrammarCheck | None) -> GrammarSpec | None:
    """n, best_of and the output constraint (returned, compile-checked by `checker`): what the
    request asks the server to return."""
    refuse_unsupported(request, UNSUPPORTED_FIELDS)
    constraint = request_grammar(request)  # a malformed one gets its own 400 here
    if constraint is not None and checker is not None:
        checker.check(*constraint)
    n = or_default(request.n, DEFAULTS.n)
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", "n")
    if request.best_of not in (None, 1, n):
        raise bad_request(f"best_of must equal n ({n}): this server returns every choice it "
                          f"generates, got best_of {request.best_of}", "best_of")
    return None if constraint is None else constraint[0]


def _check_num_logprobs(value: int | None, param: str) -> int:
    """The number of top alternatives asked for; -1 when `value` is None."""
    if value is None:
        return -1
    if not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{param} must be between 0 and {MAX_LOGPROBS}, got {value}", param)
    return value


def _check_prompt_logprobs(request: SamplingFields) -> int:
    """vLLM's prompt_logprobs (-1 when not asked): a field of the whole response, which a stream
    has no place for. As vLLM does, a stream takes 0 (and sends no prompt_logprobs) and refuses more."""
    num = _check_num_logprobs(request.prompt_logprobs, "prompt_logprobs")
    if request.stream and num > 0:
        raise bad_request(f"prompt_logprobs is not available with stream: true (got {num}; only 0 is taken)",
                          "prompt_logprobs")
    return -1 if request.stream else num


def _echo_text(prompt: Any, prompt_ids: list[int], tokenizer: Tokenizer) -> str:
    """The (unwrapped) prompt as the client sent it when that was text, else its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt_ids, skip_special_tokens=False)


def _truncated(prompt_ids: list[int], keep: int | None, limits: ModelLimits, max_tokens: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens; -1: as many as leave room
    for max_tokens (at least one) output tokens in max_model_len."""
    if keep is None:
        return prompt_ids
    longest = limits.max_model_len - 1  # a prompt leaves room for one output token at least
    if keep == -1:
        keep = max(limits.max_model_len - max(max_tokens or 1, 1), 1)
    elif not 1 <= keep <= longest:
        raise bad_request(f"truncate_prompt_tokens must be -1 or between 1 and max_model_len - 1 "
                          f"({longest}), got {keep}", "truncate_prompt_tokens")
    return prompt_ids[-keep:]


def _check_prompt_fits(prompt_ids: list[int], max_tokens: int | None, limits: ModelLimits,
                       prompt_param: str, max_tokens_param: str = "max_tokens") -> int:
    """Return the room left for output; 400 (saying both numbers) when the prompt does not fit."""
    num_prompt = len(prompt_ids)
    wanted = "" if max_tokens is None else f" (plus {max_tokens_param} {max_tokens})"
    message = (f"This model's maximum context length is {limits.max_model_len} tokens, "
               f"but the prompt has {num_prompt} tokens{wanted}")
    if not prompt_fits(num_prompt, limits.max_model_len):
        raise bad_request(message, prompt_param, "context_length_exceeded")
    if max_tokens is not None and max_tokens > 0 and num_prompt + max_tokens > limits.max_model_len:
        raise bad_request(message, max_tokens_param, "context_length_exceeded")
    return limits.max_model_len - num_prompt


def _job(request: SamplingFields, prompt_ids: list[int], max_tokens: int, limits: ModelLimits,
         logprob_fields: dict[str, int], echo_text: str | None = None,
         grammar: GrammarSpec | None = None, tool_choice: ToolChoice = ToolChoice("none"),
         bad_words: tuple[tuple[int, ...], ...] = (), prompt_logprobs: int = -1) -> GenerationJob:
    """`bad_words`: the request's, as bad_words_token_ids read them. `prompt_logprobs`: the top k
    the response shows (logprob_fields' is what the engine computes, which may be more)."""
    stream_options = request.stream_options
    if stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    include_usage = bool(request.stream and stream_options and stream_options.include_usage)
    return GenerationJob(
        prompt_token_ids=prompt_ids,
        sampling_params=sampling_params(request, max_tokens, limits.vocab_size, logprob_fields, bad_words),
        stop=stop_strings(request.stop),
        stream=bool(request.stream),
        include_usage=include_usage,
        continuous_usage=include_usage and stream_options.continuous_usage_stats,  # vLLM asks for both
        skip_special_tokens=request.skip_special_tokens,
        tokens_as_ids=bool(request.return_tokens_as_token_ids),
        include_stop_str=request.include_stop_str_in_output,
        echo_text=echo_text,
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
        tool_choice=tool_choice,
    )


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{param} token ids must be in [0, {vocab_size}), got {bad[0]}", param)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
