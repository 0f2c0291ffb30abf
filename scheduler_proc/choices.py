"""n > 1: a request's choices run as sibling sequences, each with a seed derived from the request's.

How the siblings share the prompt: choice 0 is queued alone and its siblings are HELD until it
has computed the whole prompt; then they go to the head of the waiting queue. When admitted they
take the prompt's full blocks from the prefix cache (with caching off: choice 0's prompt blocks,
by reference count) and compute only the rest of the prompt, at least one token, before sampling
their own first token. Only full, computed blocks are ever shared, so no KV block is copied or
written by two sequences; the choices differ from their first generated token on.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from proto.config import EngineConfig
from proto.messages import AddRequest, ResumedOutputs
from scheduler_proc.request import Request

if TYPE_CHECKING:
    from scheduler_proc.token_set import Constraint


def choice_seed(seed: int, choice_index: int) -> int:
    """Choice 0 keeps the request's seed (so an n=1 request and choice 0 of the same request with
    n=k sample alike); choice i > 0 gets a 63-bit blake2b hash of (seed, i), the same in every
    process and run, so a seeded request with n > 1 is reproducible."""
    if choice_index == 0:
        return seed
    digest = hashlib.blake2b(struct.pack("<qq", seed, choice_index), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def resumed_output_tokens(resume: ResumedOutputs, index: int) -> np.ndarray:
    """Choice `index`'s output tokens that a resubmission restores (int32, a view)."""
    return resume.token_ids[int(resume.cu_token_ids[index]):int(resume.cu_token_ids[index + 1])]


def make_choices(message: AddRequest, seed: int, config: EngineConfig,
                 grammars: Sequence[Constraint] = ()) -> list[Request]:
    """The leader (WAITING) and its siblings (HELD, listed in the leader's held_siblings): choice 0
    and the others, or for a resubmission (AddRequest.resume) only the unfinished choices, the
    lowest one leading, each restored with the output tokens the frontend already has. With
    `grammars` (a constrained request), choice i owns matcher grammars[i] (Constraints.start
    replayed it over a resubmission's restored tokens), or the constraint grammars[i] of
    Constraints.for_request."""
    params, resume = message.sampling_params, message.resume

    def choice(index: int, leader: Request | None) -> Request:
        grammar = grammars[index] if grammars else None
        request = Request(message.request_id, message.prompt_token_ids, params, seed=choice_seed(seed, index),
                          eos_token_ids=config.eos_token_ids, max_model_len=config.max_model_len,
                          choice_index=index, leader=leader, grammar=grammar)
        if resume is not None:
            request.restore_outputs(resumed_output_tokens(resume, index), resume.num_prompt_logprobs_received)
        return request

    indices = [index for index in range(params.n) if resume is None or not resume.finished[index]]
    leader = choice(indices[0], None)
    siblings = [choice(index, leader) for index in indices[1:]]
    leader.hold(siblings)
    return [leader, *siblings]
