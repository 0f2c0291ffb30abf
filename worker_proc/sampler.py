"""One vectorised sampling pass over per-row params; a row's token never depends on its batch-mates."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from proto.messages import StepPlan
from proto.sampling_columns import PARAM_COLUMNS

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingBatch:
    """Params of the rows that sample this step, in batch order (row r = r-th sampling member)."""

    temperature: torch.Tensor  # float32 [num_rows]
    top_k: torch.Tensor  # int64 [num_rows] (<= 0 = off)
    top_p: torch.Tensor  # float32 [num_rows]
    min_p: torch.Tensor  # float32 [num_rows]
    repetition_penalty: torch.Tensor  # float32 [num_rows]
    presence_penalty: torch.Tensor  # float32 [num_rows]
    frequency_penalty: torch.Tensor  # float32 [num_rows]
    seeds: np.ndarray  # int64 [num_rows]
    positions: np.ndarray  # int64 [num_rows] position the sampled token will occupy
    bias_rows: torch.Tensor  # int64 [num_biases]
    bias_token_ids: torch.Tensor  # int64 [num_biases]
    bias_values: torch.Tensor  # float32 [num_biases] may be -inf
    history_rows: torch.Tensor  # int64 [num_history]
    history_token_ids: torch.Tensor  # int64 [num_history]
    history_is_output: torch.Tensor  # bool [num_history] False for prompt tokens

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


def sampling_batch_from_plan(plan: StepPlan, sample_members: np.ndarray,
                             sample_positions: np.ndarray) -> SamplingBatch:
    """Select the sampling members' params and re-index biases and history by sampling row."""
    columns = plan.sampling
    row_of_member = np.full(plan.num_seqs, -1, dtype=np.int64)
    row_of_member[sample_members] = np.arange(len(sample_members))
    bias_rows = row_of_member[columns.bias.rows]
    keep_bias = bias_rows >= 0
    history = columns.history
    history_members = np.repeat(np.arange(plan.num_seqs), np.diff(history.cu))
    offsets = np.arange(len(history_members)) - history.cu[history_members]
    history_rows = row_of_member[history_members]
    keep_history = history_rows >= 0
    return SamplingBatch(
        **{name: _rows(getattr(columns, name), sample_members) for name in _PARAM_TENSORS},
        seeds=columns.seeds[sample_members], positions=np.asarray(sample_positions, dtype=np.int64),
        bias_rows=torch.from_numpy(bias_rows[keep_bias]),
        bias_token_ids=torch.from_numpy(columns.bias.token_ids[keep_bias].astype(np.int64)),
        bias_values=torch.from_numpy(columns.bias.values[keep_bias]),
        history_rows=torch.from_numpy(history_rows[keep_history]),
        history_token_ids=torch.from_numpy(history.token_ids[keep_history].astype(np.int64)),
        history_is_output=torch.from_numpy(
            (offsets >= history.num_prompt[history_members])[keep_history]),
    )


def _rows(column: np.ndarray, sample_members: np.ndarray) -> torch.Tensor:
    """The sampling rows of a column; integer columns as int64 (torch's index type)."""
    values = column[sample_members]
    return torch.from_numpy(values.astype(np.int64) if values.dtype.kind == "i" else values)


# SamplingBatch's per-row parameters: taken from the same-named SamplingColumns column.
_PARAM_TENSORS = tuple(f.name for f in fields(SamplingBatch) if f.name in PARAM_COLUMNS)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """float32 [num_rows, vocab] (modified in place) -> int64 [num_rows] token ids.

    Order: logit_bias (incl. -inf min_tokens masks) -> repetition/presence/frequency penalties ->
    greedy argmax (temperature 0) or temperature -> min_p -> top_k -> top_p -> seeded Gumbel-max.
    Every step is row-wise and leaves rows whose parameter is "off" bit-identical, so a row gets
    the same token alone, in any batch, and after preemption. The noise of (row, token j) is the
    j-th draw of a generator seeded from (seed, position): a function of (seed, position, token).
    """
    adjust_logits(logits, batch)
    greedy = batch.temperature == 0
    if bool(greedy.all()):
        return logits.argmax(dim=-1)
    random_rows = torch.nonzero(~greedy).squeeze(1)
    scaled = logits[random_rows] / batch.temperature[random_rows].unsqueeze(1)
    _apply_min_p(scaled, batch.min_p[random_rows])
    _apply_top_k_top_p(scaled, batch.top_k[random_rows], batch.top_p[random_rows])
    idx = random_rows.numpy()
    scaled.add_(gumbel_noise(batch.seeds[idx], batch.positions[idx], scaled.shape[1]))
    tokens = torch.empty(batch.num_rows, dtype=torch.int64)
    tokens[random_rows] = scaled.argmax(dim=-1)
    if bool(greedy.any()):
        greedy_rows = torch.nonzero(greedy).squeeze(1)
        tokens[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
    return tokens


def adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place, before greedy or temperature: logit_bias (incl. -inf masks), then penalties."""
    if batch.bias_rows.numel():
        logits.index_put_((batch.bias_rows, batch.bias_token_ids), batch.bias_values, accumulate=True)
    _apply_penalties(logits, batch)


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """HF repetition penalty over prompt + output; OpenAI presence/frequency over output only.
    Only the rows that use a penalty are touched (and pay for the [rows, vocab] counts)."""
    active = ((batch.repetition_penalty != 1.0) | (batch.presence_penalty != 0.0)
              | (batch.frequency_penalty != 0.0))
    if not bool(active.any()) or not batch.history_rows.numel():
        return
    rows = torch.nonzero(active).squeeze(1)  # int64 [num_active]
    sub_row = torch.full((batch.num_rows,), -1, dtype=torch.int64)
    sub_row[rows] = torch.arange(len(rows))
    vocab = logits.shape[1]
    keep = ((sub_row[batch.history_rows] >= 0) & (batch.history_token_ids >= 0)
            & (batch.history_token_ids < vocab))
    hist_rows, hist_ids = sub_row[batch.history_rows[keep]], batch.history_token_ids[keep]
    sub = logits[rows]  # [num_active, vocab]
    seen = torch.zeros_like(sub, dtype=torch.bool)
    seen[hist_rows, hist_ids] = True
    output_counts = torch.zeros_like(sub)
    output_counts.index_put_((hist_rows, hist_ids), batch.history_is_output[keep].float(),
                             accumulate=True)
    penalty = batch.repetition_penalty[rows].unsqueeze(1)
    sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    sub -= batch.frequency_penalty[rows].unsqueeze(1) * output_counts
    sub -= batch.presence_penalty[rows].unsqueeze(1) * (output_counts > 0).float()
    logits[rows] = sub


def _apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    if not bool((min_p > 0).any()):
        return
    threshold = scaled.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # -inf where off
    scaled.masked_fill_(scaled < threshold, float("-inf"))


def _apply_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep each row's `limit` largest logits: k for top_k, fewer if the top-p nucleus is smaller.

    Sorting is paid only when some row uses top_p; rows with neither are never touched.
    """
    vocab = scaled.shape[1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    if not bool((use_k | use_p).any()):
        return
    limit = torch.where(use_k, top_k, vocab)  # int64 [rows]
    if bool(use_p.any()):
        ordered = scaled.sort(dim=-1, descending=True).values  # [rows, vocab]
        ranks = torch.arange(vocab).unsqueeze(0)
        ordered.masked_fill_(ranks >= limit.unsqueeze(1), float("-inf"))
        probs = ordered.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        nucleus = (mass_before < top_p.unsqueeze(1)).sum(dim=-1).clamp(min=1)
        limit = torch.where(use_p, torch.minimum(nucleus, limit), limit)
    else:
        ordered = scaled.topk(int(limit[use_k].max()), dim=-1).values
    threshold = ordered.gather(1, (limit.clamp(max=ordered.shape[1]) - 1).unsqueeze(1))
    scaled.masked_fill_((use_k | use_p).unsqueeze(1) & (scaled < threshold), float("-inf"))


def gumbel_noise(seeds: np.ndarray, positions: np.ndarray, vocab: int) -> torch.Tensor:
    """float32 [rows, vocab]: Gumbel(0, 1) noise, a pure function of (seed, position, token id)."""
    uniform = torch.empty(len(seeds), vocab)
    generator = torch.Generator()
    for row, (seed, position) in enumerate(zip(seeds.tolist(), positions.tolist())):
        generator.manual_seed(row_seed(seed, position))
        torch.rand(vocab, generator=generator, out=uniform[row])
    return uniform.log_().neg_().log_().neg_()


def row_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): nearby seeds and positions give unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
