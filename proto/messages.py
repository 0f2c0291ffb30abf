"""Every cross-process message, as a frozen dataclass. Arrays are numpy with a fixed dtype.

Channels (one writer role, one reader role each):
  frontend  -> scheduler : AddRequest, AbortRequest
  scheduler -> worker[r] : StepPlan (the same plan to every rank)
  worker    -> scheduler : WorkerReady (every rank, once), StepResult (rank 0 only)
  scheduler -> frontend  : StepOutputs (every step, plus idle heartbeats)
  any child -> supervisor: ProcessReady, ProcessFailed
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proto.sampling import SamplingParams

FINISH_REASONS = ("", "stop", "length", "abort", "error")


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: np.ndarray  # int32 [num_prompt_tokens]
    sampling_params: SamplingParams
    arrival_time_s: float  # wall clock (time.time()) when the frontend received it

    ARRAY_DTYPES = {"prompt_token_ids": np.int32}


@dataclass(frozen=True)
class AbortRequest:
    request_ids: list[str]


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

    ARRAY_DTYPES = {
        "input_ids": np.int32, "num_computed_tokens": np.int32, "num_scheduled_tokens": np.int32,
        "cu_block_ids": np.int32, "block_ids": np.int32, "sample_mask": np.bool_,
        "temperature": np.float32, "top_p": np.float32, "top_k": np.int32, "min_p": np.float32,
        "repetition_penalty": np.float32, "presence_penalty": np.float32,
        "frequency_penalty": np.float32, "seeds": np.int64, "bias_rows": np.int32,
        "bias_token_ids": np.int32, "bias_values": np.float32, "cu_history": np.int32,
        "history_token_ids": np.int32, "history_num_prompt": np.int32,
    }

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True)
class StepResult:
    """Rank 0's answer: one token per member with sample_mask set, in batch order."""

    step_id: int
    sampled_token_ids: np.ndarray  # int32 [num_sampled]
    error: str  # "" on success; a worker-side failure fails the step's requests, not the loop

    ARRAY_DTYPES = {"sampled_token_ids": np.int32}


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
    reason, ever. Timestamps are the scheduler's wall clock (time.time()).
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

    ARRAY_DTYPES = {"cu_new_tokens": np.int32, "new_token_ids": np.int32}

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


MESSAGE_TYPES: tuple[type, ...] = (
    AddRequest, AbortRequest, StepPlan, StepResult, WorkerReady, StepOutputs,
    ProcessReady, ProcessFailed,
)
