"""NullModelRunner: answers a StepPlan without a model, to measure pure scheduler + IPC overhead."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from proto.config import EngineConfig
from proto.logprobs import LogprobEntries, concat_entries
from proto.messages import StepPlan, StepResult
from worker_proc.kv_cache import num_kv_blocks_for
from worker_proc.logprobs import prompt_targets, sampled_asks
from worker_proc.model_config import parse_model_config, torch_dtype

log = logging.getLogger(__name__)

# When neither num_kv_blocks nor a model config.json is given, size blocks as for a Llama-3-8B-like
# model (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes) so the block count stays realistic.
_NOMINAL_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
NULL_OTHER_LOGPROB = -30.0  # every token but the chosen one: e^-30 * vocab is still ~0


class NullModelRunner:
    """No weights, no KV tensors. Tokens are a hash of (seed, position), never an EOS id, so a
    request runs to max_tokens and every run of the same plans gives the same tokens."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        raw = _read_model_config(config.model)
        self.vocab_size = config.vocab_size  # the supervisor resolved it from the model
        if self.vocab_size < 2:
            raise ValueError(f"null_model needs vocab_size >= 2 (the supervisor fills it in from "
                             f"{config.model!r}/config.json), got {self.vocab_size}")
        self.eos_token_ids = np.array(sorted(set(config.eos_token_ids)), dtype=np.int64)
        self.num_kv_blocks = config.num_kv_blocks or _derived_num_blocks(config, raw)
        log.info("rank %d null model: vocab %d, %d KV blocks (none allocated)", rank,
                 self.vocab_size, self.num_kv_blocks)

    def execute(self, plan: StepPlan) -> StepResult:
        """One token per sample_mask member, in batch order, plus well-formed logprob entries
        (same positions as the real runner; see _null_entries) for the members that ask. Like
        the real runner, only rank 0 answers with tokens."""
        if self.rank != 0:
            return StepResult(step_id=plan.step_id, sampled_token_ids=np.zeros(0, np.int32), error="",
                              rank=self.rank)
        members = np.flatnonzero(plan.sample_mask)
        positions = (plan.num_computed_tokens[members].astype(np.uint64)
                     + plan.num_scheduled_tokens[members].astype(np.uint64))
        tokens = (_mix(plan.sampling.seeds[members].view(np.uint64), positions) % np.uint64(self.vocab_size))
        tokens = tokens.astype(np.int64)
        for _ in range(len(self.eos_token_ids)):  # each pass moves off at most one more EOS id
            is_eos = np.isin(tokens, self.eos_token_ids)
            if not is_eos.any():
                break
            tokens = np.where(is_eos, (tokens + 1) % self.vocab_size, tokens)
        if len(plan.grammar):  # structured output: a constrained row samples an allowed token
            constrained = np.searchsorted(members, plan.grammar.rows)  # int64 [num_constrained] sampling rows
            tokens[constrained] = _allowed_tokens(plan.grammar.matrix, tokens[constrained], self.vocab_size)
        targets = prompt_targets(plan)
        asks = sampled_asks(plan, members)
        entries = concat_entries([
            _null_entries(targets.members, targets.positions, targets.token_ids, targets.num_top,
                          self.vocab_size),
            _null_entries(members[asks], positions[asks].astype(np.int64), tokens[asks],
                          plan.sampling.logprobs[members[asks]] if asks.any() else np.zeros(0, np.int64),
                          self.vocab_size)])
        return StepResult(step_id=plan.step_id, sampled_token_ids=tokens.astype(np.int32), error="",
                          rank=self.rank, logprobs=entries)


def _null_entries(members: np.ndarray, positions: np.ndarray, token_ids: np.ndarray,
                  num_top: np.ndarray, vocab_size: int) -> LogprobEntries:
    """The null model is sure of its token: logprob 0.0; the top-k are the token and the ids after
    it (mod vocab) at NULL_OTHER_LOGPROB, so the distribution still sums to ~1."""
    num_top = np.minimum(num_top.astype(np.int64), vocab_size)  # int64 [num_entries]
    cu_top = np.zeros(len(members) + 1, dtype=np.int32)
    np.cumsum(num_top, out=cu_top[1:])
    rank_in_top = np.arange(int(cu_top[-1])) - np.repeat(cu_top[:-1], num_top)  # 0 = the token
    top_ids = (np.repeat(token_ids.astype(np.int64), num_top) + rank_in_top) % vocab_size
    return LogprobEntries(
        rows=members.astype(np.int32), positions=positions.astype(np.int32),
        token_ids=token_ids.astype(np.int32), logprobs=np.zeros(len(members), dtype=np.float32),
        ranks=np.ones(len(members), dtype=np.int32), cu_top=cu_top, top_token_ids=top_ids.astype(np.int32),
        top_logprobs=np.where(rank_in_top == 0, 0.0, NULL_OTHER_LOGPROB).astype(np.float32))


def _allowed_tokens(bitmask: np.ndarray, hashed: np.ndarray, vocab_size: int) -> np.ndarray:
    """int64 [k]: row i's allowed token number hashed[i] % num_allowed (EOS too, where the grammar
    allows it: a constrained null row can end), from int32 [k, words] bitmask rows."""
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]  # uint8 [k, vocab]
    picked = np.empty(len(bitmask), dtype=np.int64)
    for row, bits in enumerate(allowed):
        ids = np.flatnonzero(bits)
        picked[row] = ids[hashed[row] % len(ids)] if len(ids) else hashed[row]
    return picked


def _mix(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 of (seed, position); uint64 arrays wrap silently, as the hash wants."""
    x = seeds * np.uint64(0x9E3779B97F4A7C15) + positions * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _read_model_config(model_dir: str) -> dict:
    path = Path(model_dir) / "config.json" if model_dir else None
    return json.loads(path.read_text()) if path and path.is_file() else {}


def _derived_num_blocks(config: EngineConfig, raw: dict) -> int:
    """What the real worker would report when config.json is known, else a nominal count."""
    if raw:
        return num_kv_blocks_for(config, parse_model_config(raw), torch_dtype(config.kv_dtype))
    return max(1, config.kv_cache_memory_bytes // (config.block_size * _NOMINAL_KV_BYTES_PER_TOKEN))
