"""Every cross-process message, as a frozen dataclass. Arrays are numpy with a fixed dtype.

Channels (one writer role, one reader role each):
  frontend  -> scheduler : AddRequest, AbortRequest, FrontendHello (first, once per frontend)
  scheduler -> worker[r] : StepPlan (the same plan to every rank)
  worker    -> scheduler : WorkerReady (every rank, once), StepResult (rank 0 only)
  scheduler -> frontend  : StepOutputs (every step, plus idle heartbeats)
  any child -> supervisor: ProcessReady, ProcessFailed
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from proto.sampling import SamplingParams

FINISH_REASONS = ("", "stop", "length", "abort", "error")

# Why an "error" finish happened, when the frontend must tell it apart (StepOutputs.error_codes):
# QUEUE_FULL (max_num_waiting) and WAITING_TOKENS_FULL (max_waiting_tokens) are rejections that
# may succeed later (HTTP 429), NONE every other error.
ERROR_NONE, ERROR_QUEUE_FULL, ERROR_WAITING_TOKENS_FULL = range(3)
ERROR_CODES = ("", "queue_full", "waiting_tokens_full")

ALL_CHOICES = -1  # an AbortRequest.choice_indices entry: every choice of the request

# Request lifecycle events that ride with StepOutputs (scheduler wall clock), for metrics.
EVENT_QUEUED, EVENT_SCHEDULED, EVENT_FIRST_TOKEN, EVENT_PREEMPTED, EVENT_FINISHED = range(5)
EVENT_KINDS = ("queued", "scheduled", "first_token", "preempted", "finished")


def _i32() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


def _f32() -> np.ndarray:
    return np.zeros(0, dtype=np.float32)


def _f64() -> np.ndarray:
    return np.zeros(0, dtype=np.float64)


def _u8() -> np.ndarray:
    return np.zeros(0, dtype=np.uint8)


_LOGPROB_DTYPES = {"lp_rows": np.int32, "lp_positions": np.int32, "lp_token_ids": np.int32,
                   "lp_logprobs": np.float32, "lp_cu_top": np.int32, "lp_top_token_ids": np.int32,
                   "lp_top_logprobs": np.float32}


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: np.ndarray  # int32 [num_prompt_tokens]
    sampling_params: SamplingParams
    arrival_time_s: float  # wall clock (time.time()) when the frontend received it

    ARRAY_DTYPES = {"prompt_token_ids": np.int32}


@dataclass(frozen=True)
class AbortRequest:
    """Abort choice choice_indices[i] of request request_ids[i] (ALL_CHOICES: all of them); with
    no choice_indices, every choice of every listed request. One choice of an n > 1 request is
    aborted alone when the frontend has ended it (a stop string) while its siblings run on."""

    request_ids: list[str]
    choice_indices: np.ndarray = field(default_factory=_i32)  # int32 [num_request_ids] or empty

    ARRAY_DTYPES = {"choice_indices": np.int32}


@dataclass(frozen=True)
class StepPlan:
    """One step of the running batch: what each member computes and how it samples.

    Members are in batch order; their tokens are flattened in that order (ragged, no padding).
    `block_ids[cu_block_ids[i]:cu_block_ids[i+1]]` is member i's block table.
    Logit adjustments (logit_bias, and -inf on stop tokens before min_tokens) travel as
    sparse (row, token, value) triples; rows index members. Penalty history (prompt + output
    tokens) is sent only for members whose penalties are active, others have an empty range.
    """

    step_id: int
    request_ids: list[str]
    input_ids: np.ndarray  # int32 [num_tokens]
    num_computed_tokens: np.ndarray  # int32 [num_seqs] tokens already in the KV cache
    num_scheduled_tokens: np.ndarray  # int32 [num_seqs] tokens computed this step
    cu_block_ids: np.ndarray  # int32 [num_seqs + 1]
    block_ids: np.ndarray  # int32 [total_blocks]
    sample_mask: np.ndarray  # bool [num_seqs] member reaches the end of its known tokens
    temperature: np.ndarray  # float32 [num_seqs]
    top_p: np.ndarray  # float32 [num_seqs]
    top_k: np.ndarray  # int32 [num_seqs] (0 = off)
    min_p: np.ndarray  # float32 [num_seqs]
    repetition_penalty: np.ndarray  # float32 [num_seqs]
    presence_penalty: np.ndarray  # float32 [num_seqs]
    frequency_penalty: np.ndarray  # float32 [num_seqs]
    seeds: np.ndarray  # int64 [num_seqs]
    bias_rows: np.ndarray  # int32 [num_biases]
    bias_token_ids: np.ndarray  # int32 [num_biases]
    bias_values: np.ndarray  # float32 [num_biases]
    cu_history: np.ndarray  # int32 [num_seqs + 1]
    history_token_ids: np.ndarray  # int32 [total_history]
    history_num_prompt: np.ndarray  # int32 [num_seqs] how many leading history tokens are prompt
    num_logprobs: np.ndarray = field(default_factory=_i32)  # int32 [num_seqs] top-k of sampled; -1 none
    num_prompt_logprobs: np.ndarray = field(default_factory=_i32)  # int32 [num_seqs]; -1 none
    # int32 [num_seqs]: the prompt token at position num_computed + num_scheduled when that position
    # is a prompt token and the member asks for prompt logprobs, else -1 (see StepResult).
    next_prompt_token_ids: np.ndarray = field(default_factory=_i32)

    ARRAY_DTYPES = {
        "input_ids": np.int32, "num_computed_tokens": np.int32, "num_scheduled_tokens": np.int32,
        "cu_block_ids": np.int32, "block_ids": np.int32, "sample_mask": np.bool_,
        "temperature": np.float32, "top_p": np.float32, "top_k": np.int32, "min_p": np.float32,
        "repetition_penalty": np.float32, "presence_penalty": np.float32,
        "frequency_penalty": np.float32, "seeds": np.int64, "bias_rows": np.int32,
        "bias_token_ids": np.int32, "bias_values": np.float32, "cu_history": np.int32,
        "history_token_ids": np.int32, "history_num_prompt": np.int32,
        "num_logprobs": np.int32, "num_prompt_logprobs": np.int32, "next_prompt_token_ids": np.int32,
    }

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True)
class StepResult:
    """Rank 0's answer: one token per member with sample_mask set, in batch order. Every other
    rank answers too, with no tokens and no entries: an acknowledgement that names its `rank`, so
    a rank that does not answer a step can be named.

    Logprob entries (only for members that asked): entry e is the log-probability of token
    lp_token_ids[e] at sequence position lp_positions[e] of member lp_rows[e], with its top
    alternatives in lp_top_*[lp_cu_top[e]:lp_cu_top[e+1]] (descending). They come from the raw
    model logits (log_softmax before logit_bias, penalties, temperature, top-k/top-p), as vLLM's
    default. Prompt-token entries come first (by member, then position), then sampled-token
    entries (batch order). For a member with c = num_computed_tokens, s = num_scheduled_tokens:
      - num_logprobs = k >= 0 and sample_mask: one entry for the sampled token, position c + s.
      - num_prompt_logprobs = k >= 0: one entry for each position p in [c + 1, c + s - 1] (the
        chunk's tokens after its first), plus p = c + s when next_prompt_token_ids >= 0 (the
        first token of the next chunk, predicted by this chunk's last row). Position 0 never
        gets one. So a prompt of P tokens prefilled from position 0, in any chunks, gets exactly
        one entry per position 1..P-1 when the scheduler (a) asks only while c + s <= P,
        (b) sets next_prompt_token_ids to prompt[c + s] when c + s < P, else -1, and (c) computes
        the prompt from position 0 (no prefix-cache hit) and drops entries it already forwarded
        (recomputation after preemption).
    """

    step_id: int
    sampled_token_ids: np.ndarray  # int32 [num_sampled]
    error: str  # "" on success; a worker-side failure fails the step's requests, not the loop
    lp_rows: np.ndarray = field(default_factory=_i32)  # int32 [num_entries]
    lp_positions: np.ndarray = field(default_factory=_i32)  # int32 [num_entries]
    lp_token_ids: np.ndarray = field(default_factory=_i32)  # int32 [num_entries]
    lp_logprobs: np.ndarray = field(default_factory=_f32)  # float32 [num_entries]
    lp_cu_top: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int32))  # int32 [E + 1]
    lp_top_token_ids: np.ndarray = field(default_factory=_i32)  # int32 [total_top]
    lp_top_logprobs: np.ndarray = field(default_factory=_f32)  # float32 [total_top]
    rank: int = 0  # the tensor-parallel rank that answers

    ARRAY_DTYPES = {"sampled_token_ids": np.int32, **_LOGPROB_DTYPES}


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    num_kv_blocks: int
    pid: int


@dataclass(frozen=True)
class StepOutputs:
    """Everything the frontend learns in one step: token deltas, finishes and scheduler stats.

    `new_token_ids[cu_new_tokens[i]:cu_new_tokens[i+1]]` are request i's new tokens.
    `finish_reasons[i]` is "" while the request runs; each request gets exactly one non-empty
    reason, ever. `error_codes[i]` (an ERROR_* value, only on an "error" finish) says what kind
    of error it was; empty = ERROR_NONE for every row. Timestamps are the scheduler's wall clock
    (time.time()).
    """

    step_id: int  # -1 for an idle heartbeat
    request_ids: list[str]
    cu_new_tokens: np.ndarray  # int32 [num_outputs + 1]
    new_token_ids: np.ndarray  # int32 [total_new_tokens]
    finish_reasons: list[str]
    error_messages: list[str]
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    num_preemptions_total: int
    step_duration_s: float
    wall_time_s: float
    choice_indices: np.ndarray = field(default_factory=_i32)  # int32 [num_outputs] (n > 1); empty = all 0
    num_cached_tokens: np.ndarray = field(default_factory=_i32)  # int32 [num_outputs] prefix-cache hits
    event_request_ids: list[str] = field(default_factory=list)  # [num_events]
    event_choice_indices: np.ndarray = field(default_factory=_i32)  # int32 [num_events]
    event_kinds: np.ndarray = field(default_factory=_u8)  # uint8 [num_events], EVENT_* values
    event_times_s: np.ndarray = field(default_factory=_f64)  # float64 [num_events] scheduler wall clock
    num_scheduled_tokens: int = 0  # tokens computed in this step (iteration size)
    num_padded_slot_steps_total: int = 0  # static policy: seat-steps held by finished requests
    num_protocol_errors_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of those, tokens found
    lp_rows: np.ndarray = field(default_factory=_i32)  # int32 [num_entries] index into request_ids
    lp_positions: np.ndarray = field(default_factory=_i32)
    lp_token_ids: np.ndarray = field(default_factory=_i32)
    lp_logprobs: np.ndarray = field(default_factory=_f32)
    lp_cu_top: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int32))
    lp_top_token_ids: np.ndarray = field(default_factory=_i32)
    lp_top_logprobs: np.ndarray = field(default_factory=_f32)
    engine_stopping: bool = False  # the scheduler is exiting: these are its last outputs, not a sign of life
    error_codes: np.ndarray = field(default_factory=_u8)  # uint8 [num_outputs] ERROR_* values; empty = none
    num_waiting_tokens: int = 0  # tokens the waiting sequences must compute (bounded by max_waiting_tokens)
    workers_serving: bool = True  # False while the worker group is being replaced after a fault
    num_worker_restarts_total: int = 0  # worker groups replaced after a fault
    num_requests_recovered_total: int = 0  # running sequences requeued (tokens kept) by those restarts

    ARRAY_DTYPES = {"cu_new_tokens": np.int32, "new_token_ids": np.int32, "choice_indices": np.int32,
                    "num_cached_tokens": np.int32, "error_codes": np.uint8, "event_choice_indices": np.int32,
                    "event_kinds": np.uint8, "event_times_s": np.float64, **_LOGPROB_DTYPES}

    @property
    def num_outputs(self) -> int:
        return len(self.request_ids)

    def tokens_of(self, index: int) -> np.ndarray:
        return self.new_token_ids[self.cu_new_tokens[index]:self.cu_new_tokens[index + 1]]


@dataclass(frozen=True)
class ProcessReady:
    name: str
    pid: int
    detail: str


@dataclass(frozen=True)
class ProcessFailed:
    name: str
    pid: int
    message: str


@dataclass(frozen=True)
class RestartWorkers:
    """Scheduler -> supervisor: these ranks are alive but lost a step (hung); kill and replace the
    worker group. A rank that died needs no message: the supervisor sees its exit itself."""

    ranks: np.ndarray  # int32 [num_ranks]
    reason: str

    ARRAY_DTYPES = {"ranks": np.int32}


@dataclass(frozen=True)
class FrontendHello:
    """Frontend -> scheduler, the first message of every frontend process: the requests still
    unfinished belong to an earlier frontend (their clients are gone) and are aborted; `pid` is
    the process the scheduler watches so that it aborts this frontend's requests if it dies."""

    pid: int


MESSAGE_TYPES: tuple[type, ...] = (
    AddRequest, AbortRequest, StepPlan, StepResult, WorkerReady, StepOutputs,
    ProcessReady, ProcessFailed, RestartWorkers, FrontendHello,
)
