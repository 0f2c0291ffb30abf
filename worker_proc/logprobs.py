"""Log-probabilities of sampled and prompt tokens, as proto LogprobEntries for a StepResult.

They come from the raw model logits: log_softmax before logit_bias, penalties, temperature and
top-k/top-p (vLLM's default, "raw_logprobs"), so they describe the model, not the sampler. Only
rows that ask pay for log_softmax and top-k. The position rule is documented on StepResult.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from proto.logprobs import LogprobEntries
from proto.messages import StepPlan


@dataclass(frozen=True)
class PromptTargets:
    """Prompt-token entries a step owes, by member then position (numpy, built from the plan)."""

    members: np.ndarray  # int64 [num_entries] member (batch index) of each entry
    positions: np.ndarray  # int64 [num_entries] position of the token the entry is about
    token_rows: np.ndarray  # int64 [num_entries] flat token row whose logits predict that position
    token_ids: np.ndarray  # int64 [num_entries] the prompt token at that position
    num_top: np.ndarray  # int64 [num_entries] how many alternatives to report

    @property
    def num_entries(self) -> int:
        return len(self.members)


def prompt_targets(plan: StepPlan) -> PromptTargets:
    """Positions [c + 1, c + s - 1] of every asking member, plus c + s when the plan names the
    next prompt token: O(entries) numpy."""
    num_seqs, columns = plan.num_seqs, plan.sampling
    asks = columns.num_prompt_logprobs >= 0 if len(columns.num_prompt_logprobs) else np.zeros(num_seqs, bool)
    next_ids = (columns.next_prompt_token_ids.astype(np.int64) if len(columns.next_prompt_token_ids)
                else np.full(num_seqs, -1, dtype=np.int64))  # int64 [num_seqs]
    num_scheduled = plan.num_scheduled_tokens.astype(np.int64)
    first_row = np.zeros(num_seqs, dtype=np.int64)  # int64 [num_seqs] flat row of each chunk start
    np.cumsum(num_scheduled[:-1], out=first_row[1:])
    counts = np.where(asks, num_scheduled - 1 + (next_ids >= 0), 0)  # int64 [num_seqs]
    members = np.repeat(np.arange(num_seqs), counts)  # int64 [num_entries]
    starts = np.cumsum(counts) - counts
    offsets = np.arange(len(members)) - starts[members]  # 0-based entry index within its member
    token_rows = first_row[members] + offsets
    inside = offsets < num_scheduled[members] - 1  # else: the look-ahead entry of the chunk's last row
    ids_in_chunk = plan.input_ids[np.minimum(token_rows + 1, len(plan.input_ids) - 1)]
    return PromptTargets(
        members=members,
        positions=plan.num_computed_tokens[members].astype(np.int64) + 1 + offsets,
        token_rows=token_rows,
        token_ids=np.where(inside, ids_in_chunk, next_ids[members]).astype(np.int64),
        num_top=columns.num_prompt_logprobs[members].astype(np.int64) if len(members)
        else np.zeros(0, dtype=np.int64),
    )


def sampled_asks(plan: StepPlan, sample_members: np.ndarray) -> np.ndarray:
    """bool [num_sampled]: which sampling rows want the sampled token's logprob."""
    return plan.sampling.logprobs[sample_members] >= 0


def compute_entries(logprobs: torch.Tensor, token_ids: torch.Tensor, members: np.ndarray,
                    positions: np.ndarray, num_top: np.ndarray, with_ranks: bool) -> LogprobEntries:
    """logprobs: float32 [num_entries, vocab] (already log_softmax-ed); token_ids: int64
    [num_entries]; the rest int64 [num_entries]. with_ranks: count each token's rank (a pass over
    [num_entries, vocab]; only prompt entries show it, in vLLM's prompt_logprobs), else 0."""
    num_entries, vocab = logprobs.shape
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    if with_ranks:  # vLLM's count: the tokens at least as likely, itself included (ties share the worse rank)
        ranks = (logprobs >= token_logprobs.unsqueeze(1)).sum(dim=1).numpy().astype(np.int32)
    else:
        ranks = np.zeros(num_entries, dtype=np.int32)
    num_top = np.minimum(num_top, vocab)
    max_top = int(num_top.max()) if num_entries else 0
    keep = np.arange(max_top)[None, :] < num_top[:, None]  # bool [num_entries, max_top]
    if max_top:
        top = logprobs.topk(max_top, dim=-1)  # sorted, descending
        top_ids, top_values = top.indices.numpy()[keep], top.values.numpy()[keep]
    else:
        top_ids, top_values = np.zeros(0, np.int64), np.zeros(0, np.float32)
    cu_top = np.zeros(num_entries + 1, dtype=np.int32)
    np.cumsum(num_top, out=cu_top[1:])
    return LogprobEntries(
        rows=members.astype(np.int32), positions=positions.astype(np.int32),
        token_ids=token_ids.numpy().astype(np.int32),
        logprobs=token_logprobs.numpy().astype(np.float32), ranks=ranks, cu_top=cu_top,
        top_token_ids=top_ids.astype(np.int32), top_logprobs=top_values.astype(np.float32))
