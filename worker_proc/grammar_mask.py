"""Structured output in the sampler: packed allowed-token bitmask rows applied to logits rows.

The scheduler computes the bits (scheduler_proc/grammar.py); the worker only applies them, so
it keeps no grammar state and a restarted worker needs nothing back. Bit t of a row (word
t // 32, bit t % 32) is 1 when token t is allowed; a disallowed token's logit becomes -inf
before temperature, penalties and top-k/top-p, so every later stage sees only allowed tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from proto.messages import StepPlan

# int32 [32]: 1 << b; 1 << 31 is the sign bit, which `&` tests like any other.
_BITS = torch.ones(1, dtype=torch.int32) << torch.arange(32, dtype=torch.int32)


def disallowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [num_rows, vocab_size]: True where NOT allowed, from int32 [num_rows, ceil(vocab_size / 32)].

    One AND against the 32 bit values (cheaper than shift-and-mask: one pass less over the
    [num_rows, words, 32] intermediate).
    """
    assert bitmask.dtype == torch.int32 and bitmask.dim() == 2
    assert bitmask.shape[1] * 32 >= vocab_size, (bitmask.shape, vocab_size)
    bits = bitmask.unsqueeze(-1) & _BITS.to(bitmask.device)  # int32 [num_rows, words, 32]
    return (bits == 0).view(bitmask.shape[0], -1)[:, :vocab_size]


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor) -> None:
    """In place: logits[row_indices[i], t] = -inf where bit t of bitmask[i] is 0.

    logits float [num_rows, vocab_size]; bitmask int32 [num_constrained, words]; row_indices
    int64 [num_constrained], distinct rows of `logits` (the constrained members' sampling rows).
    """
    if row_indices.numel() == 0:
        return
    assert bitmask.shape[0] == row_indices.numel(), (bitmask.shape, row_indices.shape)
    disallowed = disallowed_tokens(bitmask.to(logits.device), logits.shape[1])
    rows = row_indices.to(device=logits.device, dtype=torch.int64)
    masked = logits.index_select(0, rows).masked_fill_(disallowed, float("-inf"))
    logits.index_copy_(0, rows, masked)


def apply_plan_masks_(sample_logits: torch.Tensor, plan: StepPlan, sample_members: np.ndarray) -> str:
    """Apply the plan's grammar rows to the sampling rows' logits, in place: float
    [num_sampled, vocab], row r = sample_members[r]. "" on success, else why the masks do not
    fit this worker (the step fails, the loop does not)."""
    masks = plan.grammar
    if not len(masks):
        return ""
    vocab_size = sample_logits.shape[1]
    expected_words = -(-vocab_size // 32)
    if masks.words != expected_words:
        return (f"the plan's grammar bitmask rows have {masks.words} words, this worker's vocab of "
                f"{vocab_size} needs {expected_words}")
    sampling_rows = np.searchsorted(sample_members, masks.rows)  # int64 [num_constrained]
    apply_token_bitmask_(sample_logits, torch.from_numpy(masks.matrix), torch.from_numpy(sampling_rows))
    return ""
