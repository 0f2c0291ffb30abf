"""One request's scheduler-side state: its known tokens, progress, KV block table and lifecycle."""

from __future__ import annotations

import enum

import numpy as np

from proto.sampling import SamplingParams
from scheduler_proc.stop import BiasTriples


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    RUNNING = "running"  # holds a seat in the batch
    FINISHED = "finished"  # has its finish reason; the engine has forgotten it


class Int32Array:
    """A growable int32 array: amortised O(1) appends and zero-copy views of the filled prefix.

    A view taken before a growth keeps showing the old contents; take a fresh one after appending.
    """

    def __init__(self, initial: np.ndarray | None = None, capacity: int = 16) -> None:
        size = 0 if initial is None else len(initial)
        self._data = np.empty(max(capacity, size, 1), dtype=np.int32)  # int32 [capacity]
        self._size = 0
        if initial is not None:
            self.extend(initial)

    def __len__(self) -> int:
        return self._size

    @property
    def view(self) -> np.ndarray:
        return self._data[:self._size]  # int32 [len]

    def append(self, value: int) -> None:
        self._reserve(self._size + 1)
        self._data[self._size] = value
        self._size += 1

    def extend(self, values: np.ndarray) -> None:
        end = self._size + len(values)
        self._reserve(end)
        self._data[self._size:end] = values
        self._size = end

    def clear(self) -> None:
        self._size = 0

    def _reserve(self, capacity: int) -> None:
        if capacity > len(self._data):
            grown = np.empty(max(capacity, 2 * len(self._data)), dtype=np.int32)
            grown[:self._size] = self._data[:self._size]
            self._data = grown


def max_num_kv_tokens(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """KV slots a request can ever need: every token it may feed to the model.

    The sequence stops at prompt + max_tokens tokens, or once it reaches max_model_len (0 = no
    limit) after at least one output; its last sampled token is never fed, hence the - 1.
    """
    final_len = num_prompt_tokens + max_tokens
    if max_model_len:
        final_len = min(final_len, max(max_model_len, num_prompt_tokens + 1))
    return final_len - 1


class Request:
    """A request as the scheduler sees it. The known tokens are prompt + generated tokens;
    the scheduler hands out tokens from `num_computed_tokens` until it catches up with them.

    Invariant: 0 <= num_computed_tokens <= num_tokens, and a running request's block table
    covers at least num_computed_tokens slots. Preemption drops the blocks and resets
    num_computed_tokens to 0 but keeps the generated tokens and the seed, so recompute
    reproduces the same stream.
    """

    def __init__(self, request_id: str, prompt_token_ids: np.ndarray, sampling_params: SamplingParams,
                 seed: int, arrival_time_s: float, stop_token_ids: frozenset[int],
                 logit_bias: BiasTriples, min_tokens_logit_bias: BiasTriples,
                 max_num_kv_tokens: int) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.seed = seed  # the seed actually used: the client's, or one drawn at add time
        self.arrival_time_s = arrival_time_s
        self.stop_token_ids = stop_token_ids  # stop_token_ids plus EOS unless ignore_eos
        self.logit_bias = logit_bias
        self.min_tokens_logit_bias = min_tokens_logit_bias  # logit_bias + stop tokens at -inf
        self.sampling_row = _sampling_row(sampling_params)
        self.max_num_kv_tokens = max_num_kv_tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.finish_reason = ""
        self.error_message = ""
        self.admission_order = -1  # set on every admission; preemption picks the largest
        self.num_preemptions = 0
        self._token_ids = Int32Array(prompt_token_ids,
                                     capacity=len(prompt_token_ids) + min(sampling_params.max_tokens, 256))
        self._block_ids = Int32Array()

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, blocks={len(self._block_ids)})")

    @property
    def token_ids(self) -> np.ndarray:
        return self._token_ids.view  # int32 [num_tokens] prompt + generated

    @property
    def prompt_token_ids(self) -> np.ndarray:
        return self._token_ids.view[:self.num_prompt_tokens]  # int32 [num_prompt_tokens]

    @property
    def output_token_ids(self) -> np.ndarray:
        return self._token_ids.view[self.num_prompt_tokens:]  # int32 [num_output_tokens]

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids) - self.num_prompt_tokens

    @property
    def num_remaining_tokens(self) -> int:
        return len(self._token_ids) - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return int(self._token_ids.view[-1])

    @property
    def block_ids(self) -> np.ndarray:
        return self._block_ids.view  # int32 [num_blocks_held]

    @property
    def block_table(self) -> Int32Array:
        """Mutable table; only the BlockManager writes it."""
        return self._block_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        self._token_ids.append(token_id)

    def preempt(self) -> None:
        assert len(self._block_ids) == 0, "free the blocks before preempting"
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions += 1

    def finish(self, reason: str, error_message: str = "") -> None:
        assert not self.is_finished, f"{self.request_id} finished twice"
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error_message = error_message


def _sampling_row(params: SamplingParams) -> tuple[float, ...]:
    """The plan's per-row sampling values, computed once; top_k -1 and 0 both mean off."""
    return (params.temperature, params.top_p, float(max(params.top_k, 0)), params.min_p,
            params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
