"""One sequence's scheduler-side state: its known tokens, progress, KV block table and lifecycle.

A request with SamplingParams.n = k runs as k sequences ("choices") that share its request_id
and have choice_index 0..k-1; everything here is per choice.
"""

from __future__ import annotations

import enum

import numpy as np

from proto.sampling import SamplingParams
from scheduler_proc.block_pool import BlockKey
from scheduler_proc.int32_array import Int32Array
from scheduler_proc.stop import logit_biases, stop_token_set


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    HELD = "held"  # a sibling choice, held back until choice 0 has computed the shared prompt
    RUNNING = "running"  # holds a seat in the batch
    FINISHED = "finished"  # has its finish reason; the engine has forgotten it


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
    """A sequence as the scheduler sees it. The known tokens are prompt + generated tokens;
    the scheduler hands out tokens from `num_computed_tokens` until it catches up with them.

    Invariant: 0 <= num_computed_tokens <= num_tokens, and a running sequence's block table
    covers at least num_computed_tokens slots; its first num_cached_blocks blocks are in the
    prefix cache. Preemption drops the blocks and resets num_computed_tokens to 0 but keeps the
    generated tokens, the seed and the block keys, so recompute reproduces the same stream and
    finds its surviving blocks in the cache.
    """

    def __init__(self, request_id: str, prompt_token_ids: np.ndarray, sampling_params: SamplingParams, *,
                 seed: int, arrival_time_s: float = 0.0, eos_token_ids: tuple[int, ...] = (),
                 max_model_len: int = 0, choice_index: int = 0, leader: Request | None = None) -> None:
        self.request_id = request_id
        self.choice_index = choice_index
        self.key = (request_id, choice_index)
        self.label = f"{request_id}#{choice_index}" if choice_index else request_id  # plan member name
        self.sampling_params = sampling_params
        self.seed = seed  # this choice's seed: derived from the client's, or from one drawn at add time
        self.arrival_time_s = arrival_time_s
        self.stop_token_ids = stop_token_set(sampling_params, eos_token_ids)
        self.logit_bias, self.min_tokens_logit_bias = logit_biases(sampling_params, self.stop_token_ids)
        self.max_num_kv_tokens = max_num_kv_tokens(len(prompt_token_ids), sampling_params.max_tokens,
                                                   max_model_len)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.length_limit = self.max_num_kv_tokens + 1  # num_tokens at which it stops for length
        self.status = RequestStatus.HELD if leader is not None else RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_tokens = len(prompt_token_ids)  # prompt + generated; kept as a field for the hot loops
        self.last_token_id = int(prompt_token_ids[-1])
        self.finish_reason = ""
        self.error_message = ""
        self.admission_order = -1  # set on every admission; preemption picks the largest
        self.num_preemptions = 0
        self.slot = -1  # this sequence's row in PlanConstants while it is live
        # The KV block table; only the BlockManager writes it, and refreshes block_ids (a view of
        # it, int32 [num_blocks_held]) and num_kv_slots (its length * block_size) with every change.
        self.block_table = Int32Array()
        self.block_ids = self.block_table.view
        self.num_kv_slots = 0
        self.block_keys: list[BlockKey] = []  # prefix-cache keys of its full blocks, computed lazily
        self.num_cached_blocks = 0  # leading table blocks published in (or taken from) the cache
        self.was_scheduled = False
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served at its first scheduling
        self.leader = leader  # choice 0, for a sibling choice
        self.held_siblings: list[Request] = []  # choice 0's siblings while they are held
        # Prompt logprobs are asked of choice 0 only (the prompt is the same for every choice),
        # and only until the prompt has been computed once.
        self.prompt_logprobs_pending = choice_index == 0 and sampling_params.prompt_logprobs >= 0
        self.next_prompt_logprob_position = 1  # prompt positions below this were forwarded
        self._token_ids = Int32Array(prompt_token_ids,
                                     capacity=len(prompt_token_ids) + min(sampling_params.max_tokens, 256))

    def __repr__(self) -> str:
        return (f"Request({self.label!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, blocks={len(self.block_ids)})")

    @property
    def token_ids(self) -> np.ndarray:
        return self._token_ids.view  # int32 [num_tokens] prompt + generated

    @property
    def prompt_token_ids(self) -> np.ndarray:
        return self._token_ids.view[:self.num_prompt_tokens]  # int32 [num_prompt_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def may_read_prefix_cache(self) -> bool:
        """False while prompt logprobs are owed: they are never computed for cached tokens, so
        such a prompt is computed from position 0 (its blocks are still published for others)."""
        return not self.prompt_logprobs_pending

    def token_at(self, position: int) -> int:
        return self.last_token_id if position == self.num_tokens - 1 else int(self._token_ids.view[position])

    def append_output(self, token_id: int) -> None:
        self._token_ids.append(token_id)
        self.num_tokens += 1
        self.last_token_id = token_id

    def preempt(self) -> None:
        assert len(self.block_table) == 0, "free the blocks before preempting"
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0
        self.num_preemptions += 1

    def finish(self, reason: str, error_message: str = "") -> None:
        assert not self.is_finished, f"{self.label} finished twice"
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error_message = error_message
