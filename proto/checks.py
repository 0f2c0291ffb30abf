"""Cross-field shape checks that the codec runs on every decoded dataclass (ProtocolError only)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from proto import messages
from proto.errors import ProtocolError
from proto.logprobs import LogprobEntries
from proto.sampling_columns import LogitBias, PenaltyHistory, SamplingColumns

# SamplingColumns arrays that may be empty instead of one entry per member.
_OPTIONAL_COLUMNS = ("num_prompt_logprobs", "next_prompt_token_ids")
_ROW_COLUMNS = tuple(f.name for f in dataclasses.fields(SamplingColumns)
                     if f.name not in ("bias", "history") + _OPTIONAL_COLUMNS)


def check(value: object) -> None:
    """Raise ProtocolError if `value`'s fields disagree with each other."""
    checker = _CHECKS.get(type(value))
    if checker is not None:
        checker(value)


def _check_add(message: messages.AddRequest) -> None:
    _need(len(message.prompt_token_ids) > 0, "AddRequest.prompt_token_ids is empty")
    _need(bool((message.prompt_token_ids >= 0).all()), "AddRequest has negative token ids")
    resume = message.resume
    if resume is not None:
        n = message.sampling_params.n
        _check_offsets("AddRequest.resume.cu_token_ids", resume.cu_token_ids, n, len(resume.token_ids))
        _need(len(resume.finished) == n, f"AddRequest.resume.finished needs {n} entries")
        _need(resume.num_prompt_logprobs_received >= 0, "AddRequest.resume.num_prompt_logprobs_received < 0")
        _need(bool((resume.token_ids >= 0).all()), "AddRequest.resume has negative token ids")
        _need(not resume.finished.all(), "AddRequest.resume has no unfinished choice")
        running = np.diff(resume.cu_token_ids)[~resume.finished]  # int32 [num_unfinished]
        most = int(running.max()) if len(running) else 0
        _need(most < message.sampling_params.max_tokens,
              f"AddRequest.resume has a choice with {most} tokens; max_tokens is "
              f"{message.sampling_params.max_tokens}, so it would have finished")


def _check_abort(message: messages.AbortRequest) -> None:
    n, choices = len(message.request_ids), message.choice_indices
    _need(len(choices) in (0, n), f"AbortRequest.choice_indices needs 0 or {n} entries, got {len(choices)}")
    lowest = int(choices.min()) if len(choices) else 0
    _need(lowest >= messages.ALL_CHOICES,
          f"AbortRequest.choice_indices must be >= {messages.ALL_CHOICES} (all choices), got {lowest}")


def _check_result(message: messages.StepResult) -> None:
    _need(message.rank >= 0, f"StepResult.rank must be >= 0, got {message.rank}")


def _check_outputs(message: messages.StepOutputs) -> None:
    n = message.num_outputs
    _need(len(message.finish_reasons) == n and len(message.error_messages) == n,
          "StepOutputs lists must all have one entry per request")
    _check_offsets("StepOutputs.cu_new_tokens", message.cu_new_tokens, n, len(message.new_token_ids))
    for name in ("choice_indices", "num_cached_tokens", "error_codes"):
        _need(len(getattr(message, name)) in (0, n), f"StepOutputs.{name} needs 0 or {n} entries")
    _check_error_codes(message)
    _check_rows("StepOutputs.logprobs.rows", message.logprobs.rows, n)


def _check_error_codes(message: messages.StepOutputs) -> None:
    codes = message.error_codes
    if not len(codes):
        return
    _need(int(codes.max()) < len(messages.ERROR_CODES),
          f"StepOutputs has an unknown error code {int(codes.max())}")
    coded = np.flatnonzero(codes).tolist()
    _need(all(message.finish_reasons[row] is messages.FinishReason.ERROR for row in coded),
          "StepOutputs has an error code on a row that did not finish with \"error\"")


def _check_events(events: messages.LifecycleEvents) -> None:
    num_events = len(events.request_ids)
    _need(len(events.choice_indices) == num_events and len(events.kinds) == num_events
          and len(events.times_s) == num_events, "LifecycleEvents arrays differ in length")
    _need(num_events == 0 or int(events.kinds.max()) < len(messages.EventKind),
          "LifecycleEvents has an unknown event kind")


def _check_logprobs(entries: LogprobEntries) -> None:
    num_entries = len(entries.rows)
    for name in ("positions", "token_ids", "logprobs", "ranks"):
        _need(len(getattr(entries, name)) == num_entries, f"LogprobEntries.{name} needs {num_entries} entries")
    _check_offsets("LogprobEntries.cu_top", entries.cu_top, num_entries, len(entries.top_token_ids))
    _need(len(entries.top_logprobs) == len(entries.top_token_ids),
          "LogprobEntries top logprob arrays differ in length")


def _check_bias(bias: LogitBias) -> None:
    _need(len(bias.token_ids) == len(bias.rows) and len(bias.values) == len(bias.rows),
          "LogitBias arrays differ in length")


def _check_history(history: PenaltyHistory) -> None:
    _check_offsets("PenaltyHistory.cu", history.cu, len(history.num_prompt), len(history.token_ids))


def _check_columns(columns: SamplingColumns) -> None:
    n = columns.num_seqs
    for name in _ROW_COLUMNS:
        _need(len(getattr(columns, name)) == n, f"SamplingColumns.{name} needs {n} entries")
    for name in _OPTIONAL_COLUMNS:
        _need(len(getattr(columns, name)) in (0, n), f"SamplingColumns.{name} needs 0 or {n} entries")
    _need(len(columns.history.num_prompt) == n, f"SamplingColumns.history needs {n} members")
    _check_rows("SamplingColumns.bias.rows", columns.bias.rows, n)


def _check_plan(plan: messages.StepPlan) -> None:
    n = plan.num_seqs
    for name in ("num_computed_tokens", "num_scheduled_tokens", "sample_mask"):
        _need(len(getattr(plan, name)) == n, f"StepPlan.{name} needs {n} entries")
    _need(plan.sampling.num_seqs == n, f"StepPlan.sampling needs {n} members, got {plan.sampling.num_seqs}")
    _need(bool((plan.num_scheduled_tokens >= 1).all()), "StepPlan schedules a member with no tokens")
    _need(bool((plan.num_computed_tokens >= 0).all()), "StepPlan has negative num_computed_tokens")
    _need(int(plan.num_scheduled_tokens.sum()) == len(plan.input_ids),
          "StepPlan.input_ids length differs from the sum of num_scheduled_tokens")
    _check_offsets("StepPlan.cu_block_ids", plan.cu_block_ids, n, len(plan.block_ids))
    _check_grammar_masks(plan)


def _check_grammar_masks(plan: messages.StepPlan) -> None:
    """Rows name distinct sampling members; the bitmask holds `words` words per row. Its width
    against the vocab is the worker's check: only it knows its logits' width."""
    masks = plan.grammar
    rows, num_rows = masks.rows, len(masks.rows)
    if not num_rows and not len(masks.bitmask):
        return
    _check_rows("StepPlan.grammar.rows", rows, plan.num_seqs)
    _need(len(np.unique(rows)) == num_rows, "StepPlan.grammar.rows repeats a member")
    _need(bool(plan.sample_mask[rows].all()), "StepPlan.grammar constrains a member that does not sample")
    _need(masks.words > 0 and len(masks.bitmask) == num_rows * masks.words,
          f"StepPlan.grammar.bitmask needs {num_rows} rows of {masks.words} words (words > 0), "
          f"got {len(masks.bitmask)} words")


def _check_rows(where: str, rows: np.ndarray, num_rows: int) -> None:
    _need(not len(rows) or (0 <= int(rows.min()) and int(rows.max()) < num_rows), f"{where} out of range")


def _check_offsets(where: str, offsets: np.ndarray, n: int, total: int) -> None:
    _need(len(offsets) == n + 1, f"{where} needs {n + 1} entries, got {len(offsets)}")
    _need(int(offsets[0]) == 0 and int(offsets[-1]) == total, f"{where} must run from 0 to {total}")
    _need(bool((np.diff(offsets) >= 0).all()), f"{where} must be non-decreasing")


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise ProtocolError(message)


_CHECKS: dict[type, Callable] = {
    messages.AddRequest: _check_add, messages.AbortRequest: _check_abort,
    messages.StepResult: _check_result, messages.StepOutputs: _check_outputs,
    messages.LifecycleEvents: _check_events, LogprobEntries: _check_logprobs,
    LogitBias: _check_bias, PenaltyHistory: _check_history, SamplingColumns: _check_columns,
    messages.StepPlan: _check_plan,
}
