"""The members of one step in batch order, as parallel lists: cheap to append while scheduling,
turned into the plan's arrays in one go."""

from __future__ import annotations

import numpy as np

from scheduler_proc.request import Request


class ScheduledBatch:
    """Member i computes tokens [num_computed_tokens[i], +num_scheduled_tokens[i]) of requests[i]
    and samples the next token when sample[i] (it reaches the end of its known tokens).

    A padding member is a static batch's finished seat: it re-feeds its last computed token at
    its own position (same KV slot, same value) and its sampled token is discarded.
    The batch only reads its members; the policy and engine move them.
    """

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.num_computed_tokens: list[int] = []
        self.num_scheduled_tokens: list[int] = []
        self.sample: list[bool] = []
        self.single_token_ids: list[int] = []  # the input token of each one-token member, in order
        self.chunk_rows: list[int] = []  # members computing more than one token
        self.padding_rows: list[int] = []
        self.prompt_logprob_rows: list[int] = []  # members whose prompt logprobs are still owed
        self.grammar_rows: list[int] = []  # constrained members that sample this step
        self.newly_scheduled: list[Request] = []  # sequences scheduled for the first time ever
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self.requests)

    def member_token_ids(self, sampled_token_ids: np.ndarray) -> list[int]:
        """The token each member sampled (int32 [num_sampled] in batch order), per member; -1 for
        a member that does not sample."""
        if len(sampled_token_ids) == len(self.requests):  # every member sampled: the common decode step
            return sampled_token_ids.tolist()
        token_ids = np.full(len(self.requests), -1, dtype=np.int32)  # int32 [num_seqs]
        token_ids[np.array(self.sample, dtype=np.bool_)] = sampled_token_ids
        return token_ids.tolist()

    def add(self, request: Request, num_computed_tokens: int, num_scheduled_tokens: int) -> None:
        row = len(self.requests)
        self.requests.append(request)
        self.num_computed_tokens.append(num_computed_tokens)
        self.num_scheduled_tokens.append(num_scheduled_tokens)
        samples = num_computed_tokens + num_scheduled_tokens == request.num_tokens
        self.sample.append(samples)
        if samples and request.grammar is not None:
            self.grammar_rows.append(row)
        self.num_tokens += num_scheduled_tokens
        if num_scheduled_tokens == 1:
            self.single_token_ids.append(request.token_at(num_computed_tokens))
        else:
            self.chunk_rows.append(row)
        if request.prompt_logprobs_pending:
            self.prompt_logprob_rows.append(row)

    def add_decode(self, request: Request) -> None:
        """add() for the common member: one token, the last known one, with its KV slot there."""
        if request.prompt_logprobs_pending:
            self.prompt_logprob_rows.append(len(self.requests))
        if request.grammar is not None:
            self.grammar_rows.append(len(self.requests))
        self.requests.append(request)
        self.num_computed_tokens.append(request.num_computed_tokens)
        self.num_scheduled_tokens.append(1)
        self.sample.append(True)
        self.single_token_ids.append(request.last_token_id)
        self.num_tokens += 1

    def add_first(self, request: Request, num_computed_tokens: int, num_scheduled_tokens: int,
                  newly_scheduled: bool) -> None:
        """Add a sequence that was just given blocks (new or preempted); newly_scheduled: this is
        its first scheduling ever (Request.start said so)."""
        if newly_scheduled:
            self.newly_scheduled.append(request)
        self.add(request, num_computed_tokens, num_scheduled_tokens)

    def add_padding(self, request: Request) -> None:
        position = request.num_computed_tokens - 1
        self.padding_rows.append(len(self.requests))
        self.requests.append(request)
        self.num_computed_tokens.append(position)
        self.num_scheduled_tokens.append(1)
        self.sample.append(True)
        self.single_token_ids.append(request.token_at(position))
        self.num_tokens += 1
