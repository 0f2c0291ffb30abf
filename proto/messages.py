"""Every cross-process message, as a frozen dataclass; nested parts are frozen dataclasses too.

Channels (one writer role, one reader role each; proto.sockets names what each reader accepts):
  frontend  -> scheduler : AddRequest, AbortRequest, FrontendHello (first, once per frontend)
  scheduler -> worker[r] : StepPlan (the same plan to every rank)
  worker    -> scheduler : WorkerReady (every rank, once), StepResult (every rank, every step)
  scheduler -> frontend  : StepOutputs (every step, plus idle heartbeats)
The control plane's (to and between supervisors) are in proto.control.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

import numpy as np

from proto.arrays import BoolArray, Float64Array, Int32Array, UInt8Array, empty
from proto.control import GroupLost, ProcessFailed, ProcessReady, RestartScheduler, RestartWorkers, StartGroup
from proto.grammar import GrammarSpec
from proto.logprobs import LogprobEntries
from proto.sampling import SamplingParams
from proto.sampling_columns import SamplingColumns


class FinishReason(StrEnum):
    """Why a choice ended; NONE while it runs. Each choice gets exactly one other reason, ever."""

    NONE = ""
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


# Why an "error" finish happened, when the frontend must tell it apart (StepOutputs.error_codes):
# QUEUE_FULL (max_num_waiting) and WAITING_TOKENS_FULL (max_waiting_tokens) are rejections that
# may succeed later (HTTP 429), INVALID_REQUEST one that can never run as asked (HTTP 400: the
# client must change it), NONE every other error.
ERROR_NONE, ERROR_QUEUE_FULL, ERROR_WAITING_TOKENS_FULL, ERROR_INVALID_REQUEST = range(4)
ERROR_CODES = ("", "queue_full", "waiting_tokens_full", "invalid_request")

ALL_CHOICES = -1  # an AbortRequest.choice_indices entry: every choice of the request


class EventKind(IntEnum):
    """A request lifecycle event that rides with StepOutputs (scheduler wall clock), for metrics."""

    QUEUED = 0
    SCHEDULED = 1
    FIRST_TOKEN = 2
    PREEMPTED = 3
    FINISHED = 4


EVENT_QUEUED, EVENT_SCHEDULED, EVENT_FIRST_TOKEN, EVENT_PREEMPTED, EVENT_FINISHED = EventKind


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: Int32Array  # [num_prompt_tokens]
    sampling_params: SamplingParams
    arrival_time_s: float  # wall clock (time.time()) when the frontend received it
    grammar: GrammarSpec | None = None  # the output constraint, checked by the frontend
    resume: ResumedOutputs | None = None  # a resubmission to a replaced scheduler: continue from there


@dataclass(frozen=True)
class ResumedOutputs:
    """What the frontend had received of a request when its scheduler was lost, per choice:
    `token_ids[cu_token_ids[c]:cu_token_ids[c + 1]]` are choice c's output tokens so far (the new
    scheduler creates the choice with them already generated), `finished[c]` a choice that ended
    (it is not run again), and prompt logprobs of positions below `num_prompt_logprobs_received`
    reached the frontend already (they are not sent twice)."""

    cu_token_ids: Int32Array  # [n + 1]
    token_ids: Int32Array  # [total_resumed_tokens]
    finished: BoolArray  # [n]
    num_prompt_logprobs_received: int = 0  # prompt positions 1..this - 1 were forwarded


@dataclass(frozen=True)
class AbortRequest:
    """Abort choice choice_indices[i] of request request_ids[i] (ALL_CHOICES: all of them); with
    no choice_indices, every choice of every listed request. One choice of an n > 1 request is
    aborted alone when the frontend has ended it (a stop string) while its siblings run on."""

    request_ids: list[str]
    choice_indices: Int32Array = field(default_factory=empty(np.int32))  # [num_request_ids] or empty


@dataclass(frozen=True)
class GrammarMasks:
    """The allowed next tokens of the plan's constrained members (structured output).

    Row i constrains member rows[i], which samples this step; its packed bitmask is
    bitmask[i * words:(i + 1) * words] (bit t % 32 of word t // 32 is 1 when token t is allowed,
    words = ceil(vocab_size / 32), which the worker checks against its vocab). Flat on the wire
    because the codec carries 1-D arrays; `matrix` is the [num_constrained, words] view. Empty
    when no member is constrained, the common case, which costs three empty fields.
    """

    rows: Int32Array = field(default_factory=empty(np.int32))  # [num_constrained] member indices, distinct
    words: int = 0  # int32 words per row
    bitmask: Int32Array = field(default_factory=empty(np.int32))  # [num_constrained * words]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def matrix(self) -> np.ndarray:
        return self.bitmask.reshape(len(self.rows), self.words)  # int32 [num_constrained, words]


@dataclass(frozen=True)
class StepPlan:
    """One step of the running batch: what each member computes and how it samples.

    Members are in batch order; their tokens are flattened in that order (ragged, no padding).
    `block_ids[cu_block_ids[i]:cu_block_ids[i+1]]` is member i's block table.
    """

    step_id: int
    request_ids: list[str]
    input_ids: Int32Array  # [num_tokens]
    num_computed_tokens: Int32Array  # [num_seqs] tokens already in the KV cache
    num_scheduled_tokens: Int32Array  # [num_seqs] tokens computed this step
    cu_block_ids: Int32Array  # [num_seqs + 1]
    block_ids: Int32Array  # [total_blocks]
    sample_mask: BoolArray  # [num_seqs] member reaches the end of its known tokens
    sampling: SamplingColumns
    grammar: GrammarMasks = field(default_factory=GrammarMasks)
    generation: int = 0  # the worker group it is for (WorkerReady.generation); other groups refuse it

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True)
class StepResult:
    """Rank 0's answer: one token per member with sample_mask set, in batch order. Every other
    rank answers too, with no tokens and no entries: an acknowledgement that names its `rank`, so
    a rank that does not answer a step can be named.

    Logprob entries (only for members that asked, rows = members; see LogprobEntries). They come
    from the raw model logits (log_softmax before logit_bias, penalties, temperature, top-k/top-p),
    as vLLM's default. Prompt-token entries come first (by member, then position), then sampled-token
    entries (batch order). For a member with c = num_computed_tokens, s = num_scheduled_tokens:
      - sampling.logprobs = k >= 0 and sample_mask: one entry for the sampled token, position c + s.
      - sampling.num_prompt_logprobs = k >= 0: one entry for each position p in [c + 1, c + s - 1] (the
        chunk's tokens after its first), plus p = c + s when next_prompt_token_ids >= 0 (the
        first token of the next chunk, predicted by this chunk's last row). Position 0 never
        gets one. So a prompt of P tokens prefilled from position 0, in any chunks, gets exactly
        one entry per position 1..P-1 when the scheduler (a) asks only while c + s <= P,
        (b) sets next_prompt_token_ids to prompt[c + s] when c + s < P, else -1, and (c) computes
        the prompt from position 0 (no prefix-cache hit) and drops entries it already forwarded
        (recomputation after preemption).
    """

    step_id: int
    sampled_token_ids: Int32Array  # [num_sampled]
    error: str  # "" on success; a worker-side failure fails the step's requests, not the loop
    logprobs: LogprobEntries = field(default_factory=LogprobEntries)
    rank: int = 0  # the tensor-parallel rank that answers


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    num_kv_blocks: int
    pid: int
    generation: int = 0  # the worker group this rank belongs to (EngineConfig.worker_generation)
    dtype: str = ""  # EngineConfig.dtype as this rank's node resolved it; every rank must agree
    kv_cache_dtype: str = ""  # EngineConfig.kv_dtype, likewise


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state as of one StepOutputs (a step or an idle heartbeat); *_total are
    running totals since it started."""

    num_running: int  # sequences (choices) holding a seat
    num_waiting: int  # sequences waiting, held siblings included
    num_waiting_tokens: int  # tokens the waiting sequences must compute (bounded by max_waiting_tokens)
    kv_cache_usage: float  # fraction of KV blocks held by sequences, 0..1
    num_preemptions_total: int
    num_padded_slot_steps_total: int = 0  # static policy: seat-steps held by finished requests
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of those, tokens found
    num_requests_recovered_total: int = 0  # running sequences requeued (tokens kept) by worker restarts
    num_protocol_errors_total: int = 0
    num_worker_restarts_total: int = 0  # worker groups replaced after a fault
    workers_serving: bool = True  # False while the worker group is being replaced after a fault
    scheduler_pid: int = 0  # the scheduler process that sent it: a new one means a replaced scheduler
    step_running_s: float = 0.0  # a heartbeat during a step: how long it has run so far (else 0)
    step_idle_s: float = 0.0  # ... and how long its ranks on the scheduler's node have used no CPU
    frontend_epoch: int = 0  # FrontendHello.epoch of the last hello it read (the scheduler sends -1 before any)
    scheduler_rss_bytes: int = 0  # the scheduler's resident memory (0 = unknown), sampled once a second
    workers_rss_bytes: int = 0  # ... and its node's worker ranks', summed


@dataclass(frozen=True)
class LifecycleEvents:
    """Event e: request_ids[e]'s choice choice_indices[e] reached kinds[e] at times_s[e]."""

    request_ids: list[str] = field(default_factory=list)  # [num_events]
    choice_indices: Int32Array = field(default_factory=empty(np.int32))  # [num_events]
    kinds: UInt8Array = field(default_factory=empty(np.uint8))  # [num_events] EventKind values
    times_s: Float64Array = field(default_factory=empty(np.float64))  # [num_events] scheduler wall clock

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True)
class StepOutputs:
    """Everything the frontend learns in one step: token deltas, finishes and scheduler stats.

    `new_token_ids[cu_new_tokens[i]:cu_new_tokens[i+1]]` are request i's new tokens.
    `finish_reasons[i]` is NONE while the request runs; each request gets exactly one other
    reason, ever. `error_codes[i]` (an ERROR_* value, only on an ERROR finish) says what kind
    of error it was; empty = ERROR_NONE for every row. Timestamps are the scheduler's wall clock
    (time.time()). `logprobs.rows` index these outputs.
    """

    step_id: int  # -1 for an idle heartbeat
    request_ids: list[str]
    cu_new_tokens: Int32Array  # [num_outputs + 1]
    new_token_ids: Int32Array  # [total_new_tokens]
    finish_reasons: list[FinishReason]  # [num_outputs]
    error_messages: list[str]  # [num_outputs]
    stats: SchedulerStats
    step_duration_s: float = 0.0
    wall_time_s: float = 0.0
    num_scheduled_tokens: int = 0  # tokens computed in this step (iteration size)
    choice_indices: Int32Array = field(default_factory=empty(np.int32))  # [num_outputs] (n > 1); empty = all 0
    num_cached_tokens: Int32Array = field(default_factory=empty(np.int32))  # [num_outputs] prefix-cache hits
    error_codes: UInt8Array = field(default_factory=empty(np.uint8))  # [num_outputs] ERROR_* values; empty = none
    events: LifecycleEvents = field(default_factory=LifecycleEvents)
    logprobs: LogprobEntries = field(default_factory=LogprobEntries)
    engine_stopping: bool = False  # the scheduler is exiting: these are its last outputs, not a sign of life

    @property
    def num_outputs(self) -> int:
        return len(self.request_ids)

    def tokens_of(self, index: int) -> np.ndarray:
        return self.new_token_ids[self.cu_new_tokens[index]:self.cu_new_tokens[index + 1]]


@dataclass(frozen=True)
class FrontendHello:
    """Frontend -> scheduler, the first message of every frontend process: the requests still
    unfinished belong to an earlier frontend (their clients are gone) and are aborted; `pid` is
    the process the scheduler watches so that it aborts this frontend's requests if it dies.

    A frontend says hello again, with the next `epoch`, to a scheduler that replaced a lost one,
    before it resubmits its requests; the scheduler stamps every StepOutputs with the epoch of the
    last hello it read (SchedulerStats.frontend_epoch), so the frontend can tell outputs sent
    before its resubmissions (dropped) from those after."""

    pid: int
    epoch: int = 0


# Every message type, in tag order (the codec numbers them by position: append only).
MESSAGE_TYPES: tuple[type, ...] = (
    AddRequest, AbortRequest, StepPlan, StepResult, WorkerReady, StepOutputs,
    ProcessReady, ProcessFailed, RestartWorkers, FrontendHello, GroupLost, StartGroup, RestartScheduler,
)
