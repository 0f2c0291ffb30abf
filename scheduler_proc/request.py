"""One sequence's scheduler-side state and the transitions that write it: admit, start, advance, preempt, finish.

A request with SamplingParams.n = k runs as k sequences ("choices") that share its request_id
and have choice_index 0..k-1; everything here is per choice.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from proto.sampling import SamplingParams
from scheduler_proc.block_pool import BlockKey, extend_block_keys
from scheduler_proc.int32_array import Int32Array
from scheduler_proc.stop import logit_biases, stop_token_set

if TYPE_CHECKING:
    from scheduler_proc.token_set import Constraint

_NO_BLOCKS = np.empty(0, dtype=np.int32)  # int32 [0]: the table of a sequence that holds no block
_NO_BLOCKS.flags.writeable = False


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

    Ownership: every attribute is written by this class's methods only; the queues, policies,
    block manager, plan constants and engine call them and otherwise only read. Lifecycle:
    WAITING -admit-> RUNNING -preempt-> WAITING; HELD -release (by choice 0)-> WAITING; any of
    them -finish-> FINISHED. Progress: start (its first blocks of an admission), advance (a step).
    The block table is written through add_blocks / mark_blocks_cached / drop_blocks, which the
    BlockManager calls: it decides which blocks, the request records them.

    Invariant: 0 <= num_computed_tokens <= num_tokens, and a running sequence's block table
    covers at least num_computed_tokens slots; its first num_cached_blocks blocks are in the
    prefix cache. Preemption drops the blocks and resets num_computed_tokens to 0 but keeps the
    generated tokens, the seed and the block keys, so recompute reproduces the same stream and
    finds its surviving blocks in the cache.
    """

    def __init__(self, request_id: str, prompt_token_ids: np.ndarray, sampling_params: SamplingParams, *,
                 seed: int, eos_token_ids: tuple[int, ...] = (), max_model_len: int = 0,
                 choice_index: int = 0, leader: Request | None = None,
                 grammar: Constraint | None = None) -> None:
        num_prompt_tokens = len(prompt_token_ids)
        self.request_id = request_id
        self.choice_index = choice_index
        self.label = f"{request_id}#{choice_index}" if choice_index else request_id  # plan member name
        self.sampling_params = sampling_params
        self.seed = seed  # this choice's seed: derived from the client's, or from one drawn at add time
        self.stop_token_ids = stop_token_set(sampling_params, eos_token_ids)
        self.logit_bias, self.min_tokens_logit_bias = logit_biases(sampling_params, self.stop_token_ids)
        # The length limit: the sequence stops for "length" once num_tokens exceeds it.
        self.max_num_kv_tokens = max_num_kv_tokens(num_prompt_tokens, sampling_params.max_tokens, max_model_len)
        self.num_prompt_tokens = num_prompt_tokens
        self.status = RequestStatus.HELD if leader is not None else RequestStatus.WAITING
        self.finish_reason = ""
        self.error_message = ""
        self.admission_order = -1  # set on every admission; preemption picks the largest
        self.slot = -1  # this sequence's row in PlanConstants while it is live
        self.num_computed_tokens = 0
        # num_tokens and last_token_id repeat len(token_ids) and token_ids[-1], kept because they
        # pay: the policy, batch and engine read num_tokens about 6 times and last_token_id twice
        # per member per step; an attribute read costs 0.01-0.04 us here against 0.18 us for
        # len() of the token array and 1.3 us for int(token_ids[-1]), about 0.9 ms more per step
        # at 256 members (a step's whole schedule + update costs 0.65 ms). Only advance writes the three.
        self.num_tokens = num_prompt_tokens
        self.last_token_id = int(prompt_token_ids[-1])
        self._token_ids = Int32Array(prompt_token_ids, capacity=num_prompt_tokens + min(sampling_params.max_tokens, 256))
        self.was_scheduled = False
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served at its first scheduling
        self.block_ids = _NO_BLOCKS  # int32 [num_blocks_held], the block table; replaced, never written in place
        self.block_keys: list[BlockKey] = []  # prefix-cache keys of its full blocks, computed lazily
        self.num_cached_blocks = 0  # leading table blocks published in (or taken from) the cache
        self.leader = leader  # choice 0, for a sibling choice
        self.held_siblings: list[Request] = []  # choice 0's siblings while they are held
        # Prompt logprobs are asked of choice 0 only (the prompt is the same for every choice),
        # and only until the prompt has been computed once.
        self.prompt_logprobs_pending = choice_index == 0 and sampling_params.prompt_logprobs >= 0
        self.next_prompt_logprob_position = 1  # prompt positions below this were forwarded
        # Structured output: this sequence's own matcher, advanced by every token it accepts (so
        # preemption, recompute and worker recovery leave it as it is), or its allowed_token_ids
        # (TokenSet), bad_words (BadWords) or several at once (AllOf): scheduler_proc/token_set.py's
        # Constraint; its `error`, once set, ends the sequence with "error" (stop.stop_reason).
        # Keep this class at 30 attributes or fewer: CPython 3.11 stops sharing instance-dict keys
        # beyond 30, and every attribute read on the hot path gets slower (measured: +20% on a
        # 256-sequence step at 31).
        self.grammar = grammar
        # Steps that failed (a worker raised) with this sequence in the batch, positive while it
        # owes a solo step (one that samples its next token with no other member: solo_owed),
        # negated once it has sampled one. One signed field, not two: see the 30-attribute note.
        self.failed_steps = 0

    def __repr__(self) -> str:
        return (f"Request({self.label!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, blocks={len(self.block_ids)})")

    @property
    def token_ids(self) -> np.ndarray:
        return self._token_ids.view  # int32 [num_tokens] prompt + generated

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def key(self) -> tuple[str, int]:
        """(request_id, choice_index): unique among live sequences. Derived, not stored (read on
        allocation and release only), to stay within the 30-attribute note."""
        return self.request_id, self.choice_index

    @property
    def solo_owed(self) -> bool:
        """It was in a step that failed and has not sampled a token since: it runs alone until it
        does, so that an input that makes the worker raise again does so in a step of its own."""
        return self.failed_steps > 0

    @property
    def may_read_prefix_cache(self) -> bool:
        """False while prompt logprobs are owed: they are never computed for cached tokens, so
        such a prompt is computed from position 0 (its blocks are still published for others)."""
        return not self.prompt_logprobs_pending

    def restore_outputs(self, output_token_ids: np.ndarray, num_prompt_logprobs_received: int) -> None:
        """A request resubmitted to a replaced scheduler: its output tokens so far (int32
        [num_resumed]) were generated already (like a preempted sequence, it recomputes prompt +
        output before it samples the next one), so max_tokens, min_tokens, penalties and the stop
        rule count them; prompt logprobs below num_prompt_logprobs_received were forwarded, and
        none are owed once an output token exists (the prompt was computed)."""
        assert self.num_computed_tokens == 0 and self.num_output_tokens == 0 and not self.was_scheduled, \
            f"{self} restored after it started"
        assert len(output_token_ids) < self.max_num_kv_tokens + 1 - self.num_prompt_tokens, \
            f"{self} restored with {len(output_token_ids)} tokens: it would have finished"
        if len(output_token_ids):
            self._token_ids.extend(output_token_ids)
            self.num_tokens += len(output_token_ids)
            self.last_token_id = int(output_token_ids[-1])
        self.forwarded_prompt_logprobs(num_prompt_logprobs_received)
        if len(output_token_ids) or self.next_prompt_logprob_position >= self.num_prompt_tokens:
            self.prompt_logprobs_pending = False

    def token_at(self, position: int) -> int:
        return self.last_token_id if position == self.num_tokens - 1 else int(self._token_ids.view[position])

    # Lifecycle.

    def hold(self, siblings: Sequence[Request]) -> None:
        """Choice 0 holds its sibling choices until it has computed the shared prompt."""
        assert all(s.leader is self and s.status is RequestStatus.HELD for s in siblings)
        self.held_siblings = list(siblings)

    def release_siblings(self) -> list[Request]:
        """Choice 0 lets its held siblings wait for a seat; they are returned in choice order."""
        siblings, self.held_siblings = self.held_siblings, []
        for sibling in siblings:
            sibling.status = RequestStatus.WAITING
        return siblings

    def drop_held_sibling(self, sibling: Request) -> None:
        """Choice 0 forgets a held sibling that finished before it was released."""
        self.held_siblings.remove(sibling)

    def admit(self, admission_order: int) -> None:
        """A waiting sequence takes a seat; admission_order grows with every admission."""
        assert self.status is RequestStatus.WAITING, f"{self} admitted"
        self.status = RequestStatus.RUNNING
        self.admission_order = admission_order

    def preempt(self) -> None:
        """A running sequence gives back its seat and progress (its blocks are dropped already)."""
        assert len(self.block_ids) == 0, "free the blocks before preempting"
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0

    def finish(self, reason: str, error_message: str = "") -> None:
        assert not self.is_finished, f"{self.label} finished twice"
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error_message = error_message

    def step_failed(self) -> int:
        """A step with it in the batch failed: it owes a solo step. How many have failed so far."""
        self.failed_steps = abs(self.failed_steps) + 1
        return self.failed_steps

    def attach_plan_row(self, slot: int) -> None:
        assert self.slot < 0, f"{self} already holds plan row {self.slot}"
        self.slot = slot

    def detach_plan_row(self) -> int:
        """Give back the PlanConstants row (the sequence is finished)."""
        slot, self.slot = self.slot, -1
        assert slot >= 0, f"{self} holds no plan row"
        return slot

    # Progress.

    def start(self, num_computed_tokens: int, num_cache_hit_tokens: int) -> bool:
        """Its first blocks of an admission came with a computed prefix of num_computed_tokens
        (num_cache_hit_tokens of them found in the prefix cache). True on its first scheduling
        ever, which fixes num_cached_tokens."""
        self.num_computed_tokens = num_computed_tokens
        if self.was_scheduled:
            return False
        self.was_scheduled = True
        self.num_cached_tokens = min(num_cache_hit_tokens, self.num_prompt_tokens)
        return True

    def advance(self, num_scheduled_tokens: int, token_id: int) -> None:
        """A step computed num_scheduled_tokens more tokens and, when token_id >= 0, sampled the
        next one, which its grammar (if any) consumes. Once the prompt is computed, no prompt
        logprobs are owed any more."""
        num_computed = self.num_computed_tokens = self.num_computed_tokens + num_scheduled_tokens
        if self.prompt_logprobs_pending and num_computed >= self.num_prompt_tokens:
            self.prompt_logprobs_pending = False
        if token_id >= 0:
            self._token_ids.append(token_id)
            self.num_tokens += 1
            self.last_token_id = token_id
            if self.failed_steps > 0:
                self.failed_steps = -self.failed_steps
            if self.grammar is not None:
                self.grammar.accept(token_id)

    def forwarded_prompt_logprobs(self, up_to_position: int) -> None:
        """Prompt logprobs of positions below up_to_position reached the frontend."""
        self.next_prompt_logprob_position = max(self.next_prompt_logprob_position, up_to_position)

    # The KV block table (the BlockManager decides, the request records).

    def add_blocks(self, block_ids: Sequence[int], num_cached_blocks: int | None = None) -> None:
        """Append block_ids to the table; num_cached_blocks: the table's leading blocks now
        known to be in the prefix cache (only for blocks taken from it)."""
        new = np.asarray(block_ids, dtype=np.int32)
        self.block_ids = new if len(self.block_ids) == 0 else np.concatenate((self.block_ids, new))
        if num_cached_blocks is not None:
            self.num_cached_blocks = num_cached_blocks

    def mark_blocks_cached(self, num_cached_blocks: int) -> None:
        """The table's first num_cached_blocks blocks are published in the prefix cache."""
        self.num_cached_blocks = num_cached_blocks

    def drop_blocks(self) -> np.ndarray:
        """Empty the table; the blocks it held (int32 [num_blocks]) for the caller to release."""
        block_ids, self.block_ids = self.block_ids, _NO_BLOCKS
        self.num_cached_blocks = 0
        return block_ids

    def compute_block_keys(self, num_blocks: int, block_size: int) -> list[BlockKey]:
        """block_keys, grown to cover at least its first num_blocks full blocks (read it, never
        write it: keys depend only on token ids, so they are kept across preemption)."""
        extend_block_keys(self.block_keys, self.token_ids, num_blocks, block_size)
        return self.block_keys
