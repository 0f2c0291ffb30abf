"""Fakes for scheduler tests: a scripted worker with a token-id "KV cache", and an engine harness."""

from __future__ import annotations

import random
import time
import zlib
from collections.abc import Sequence

import numpy as np

from proto import codec
from proto.config import EngineConfig
from proto.messages import (ALL_CHOICES, EVENT_FINISHED, EVENT_FIRST_TOKEN, EVENT_PREEMPTED, EVENT_QUEUED,
                            EVENT_SCHEDULED, AddRequest, StepOutputs, StepPlan, StepResult)
from proto.logprobs import LogprobEntries
from proto.sampling import SamplingParams
from scheduler_proc.engine import SchedulerEngine

FILLER_TOKEN = 9  # what the fake worker samples instead of a token the plan masked to -inf


def default_token(request_id: str, position: int) -> int:
    """A token that depends only on (request, position), never on batch-mates: in [10, 100)."""
    return 10 + zlib.crc32(f"{request_id}:{position}".encode()) % 90


class FakeWorker:
    """Answers plans like rank 0 would, with scripted tokens.

    Its KV cache stores the token id fed at each slot; before sampling a member it reads the
    member's whole prefix back through the block table and checks it against the prompt plus
    the tokens sampled so far, so a wrong block table or a block shared by two requests fails.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 scripts: dict[str, Sequence[int]] | None = None) -> None:
        self.block_size = block_size
        self.kv_slots = np.full(num_blocks * block_size, -1, dtype=np.int64)  # int64 [num_slots]
        self.scripts = scripts or {}
        self.sequences: dict[str, list[int]] = {}  # prompt + tokens sampled, per request
        self.prompt_lengths: dict[str, int] = {}
        self.plans: list[StepPlan] = []
        self.fail_next_step = ""
        self.obeys_bias = True  # False: a broken worker that samples masked tokens anyway

    def expect(self, request_id: str, prompt: Sequence[int]) -> None:
        self.sequences[request_id] = list(prompt)
        self.prompt_lengths[request_id] = len(prompt)

    def __call__(self, plan: StepPlan) -> StepResult:
        plan = codec.decode(codec.encode(plan), type(plan))  # the worker only ever sees the decoded plan
        self.plans.append(plan)
        if self.fail_next_step:
            error, self.fail_next_step = self.fail_next_step, ""
            return StepResult(plan.step_id, np.empty(0, dtype=np.int32), error)
        sampled = []
        entries: list[tuple[int, int, int, int]] = []  # (row, position, token, num_top)
        offsets = np.concatenate([[0], np.cumsum(plan.num_scheduled_tokens)])
        for row, request_id in enumerate(plan.request_ids):
            start = int(plan.num_computed_tokens[row])
            end = start + int(plan.num_scheduled_tokens[row])
            table = plan.block_ids[plan.cu_block_ids[row]:plan.cu_block_ids[row + 1]]
            chunk = plan.input_ids[offsets[row]:offsets[row + 1]]
            self.kv_slots[self._slots(table, start, end)] = chunk
            if plan.sampling.num_prompt_logprobs[row] >= 0:
                next_id = int(plan.sampling.next_prompt_token_ids[row])
                targets = list(zip(range(start + 1, end), chunk[1:].tolist()))
                targets += [(end, next_id)] if next_id >= 0 else []
                entries += [(row, p, t, int(plan.sampling.num_prompt_logprobs[row])) for p, t in targets]
            if plan.sample_mask[row]:
                sampled.append(self._sample(plan, row, request_id, table, end))
                if plan.sampling.logprobs[row] >= 0:
                    entries.append((row, end, sampled[-1], int(plan.sampling.logprobs[row])))
        return StepResult(plan.step_id, np.array(sampled, dtype=np.int32), "", fake_logprobs(entries))

    def _slots(self, table: np.ndarray, start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        assert end <= len(table) * self.block_size, f"block table too short for position {end - 1}"
        return table[positions // self.block_size].astype(np.int64) * self.block_size + positions % self.block_size

    def _sample(self, plan: StepPlan, row: int, request_id: str, table: np.ndarray, end: int) -> int:
        sequence = self.sequences[request_id]
        cached = self.kv_slots[self._slots(table, 0, end)]
        assert cached.tolist() == sequence[:end], f"KV of {request_id} corrupted before position {end}"
        token = self._scripted(request_id, end)
        bias = plan.sampling.bias
        banned = bias.token_ids[(bias.rows == row) & np.isneginf(bias.values)]
        if self.obeys_bias and token in banned.tolist():
            token = FILLER_TOKEN
        if end == len(sequence):  # a live member; a static batch's padding seat re-samples old positions
            sequence.append(token)
        return token

    def _scripted(self, request_id: str, position: int) -> int:
        script = self.scripts.get(request_id)
        index = position - self.prompt_lengths[request_id]
        if script is not None and 0 <= index < len(script):
            return int(script[index])
        return default_token(request_id, position)


def fake_logprob(token_id: int, position: int) -> float:
    """What the fake worker reports as the logprob of `token_id` at `position`."""
    return -((token_id * 7 + position) % 13) / 4.0


def fake_logprobs(entries: list[tuple[int, int, int, int]]) -> LogprobEntries:
    """StepResult logprob entries for (row, position, token, num_top) entries; the top-k alternatives
    are token + 1 .. token + k."""
    num_top = [k for _, _, _, k in entries]
    top_ids = [t + 1 + j for _, _, t, k in entries for j in range(k)]
    return LogprobEntries(rows=np.array([e[0] for e in entries], np.int32),
                          positions=np.array([e[1] for e in entries], np.int32),
                          token_ids=np.array([e[2] for e in entries], np.int32),
                          logprobs=np.array([fake_logprob(t, p) for _, p, t, _ in entries], np.float32),
                          ranks=np.array([p % 5 + 1 for _, p, _, _ in entries], np.int32),
                          cu_top=np.concatenate([[0], np.cumsum(num_top)]).astype(np.int32),
                          top_token_ids=np.array(top_ids, np.int32),
                          top_logprobs=np.full(len(top_ids), -9.0, np.float32))


def choice_key(request_id: str, choice_index: int) -> str:
    """How tests (and plans) name a choice: the request id for choice 0, "id#i" for the others."""
    return f"{request_id}#{choice_index}" if choice_index else request_id


class OutputLog:
    """Every StepOutputs the engine produced, checked on arrival: at most one terminal output per
    choice and nothing after it; lifecycle events in order (QUEUED, SCHEDULED, FIRST_TOKEN once
    each, PREEMPTED any number of times, FINISHED once and last, with the terminal output).
    Choices are keyed by choice_key."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.error_messages: dict[str, str] = {}
        self.num_cached_tokens: dict[str, int] = {}
        self.events: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[tuple[int, int, float, list[int]]]] = {}  # (position, token, lp, top)
        self.ranks: dict[str, list[int]] = {}  # each entry's rank, in the order of logprobs
        self.messages: list[StepOutputs] = []

    def record(self, outputs: StepOutputs) -> None:
        outputs = codec.decode(codec.encode(outputs), type(outputs))
        self.messages.append(outputs)
        assert len(outputs.choice_indices) == len(outputs.num_cached_tokens) == outputs.num_outputs
        keys = [choice_key(r, int(c)) for r, c in zip(outputs.request_ids, outputs.choice_indices)]
        for index, key in enumerate(keys):
            assert key not in self.finish_reasons, f"{key} got an output after finishing"
            self.tokens.setdefault(key, []).extend(outputs.tokens_of(index).tolist())
            self.num_cached_tokens.setdefault(key, int(outputs.num_cached_tokens[index]))
            assert self.num_cached_tokens[key] == int(outputs.num_cached_tokens[index])
            if outputs.finish_reasons[index]:
                self.finish_reasons[key] = outputs.finish_reasons[index]
                self.error_messages[key] = outputs.error_messages[index]
        self._record_events(outputs)
        self._record_logprobs(outputs, keys)

    def _record_events(self, outputs: StepOutputs) -> None:
        for request_id, choice, kind in zip(outputs.events.request_ids, outputs.events.choice_indices.tolist(),
                                            outputs.events.kinds.tolist()):
            key = choice_key(request_id, choice)
            seen = self.events.setdefault(key, [])
            assert EVENT_FINISHED not in seen, f"{key} has an event after FINISHED"
            assert kind == EVENT_PREEMPTED or kind not in seen, f"{key} got event {kind} twice"
            assert kind in (EVENT_QUEUED, EVENT_FINISHED) or EVENT_QUEUED in seen, f"{key}: {kind} before QUEUED"
            assert kind != EVENT_FIRST_TOKEN or EVENT_SCHEDULED in seen, f"{key}: first token before scheduled"
            seen.append(kind)
            assert (kind == EVENT_FINISHED) == (key in self.finish_reasons and kind == EVENT_FINISHED)

    def _record_logprobs(self, outputs: StepOutputs, keys: list[str]) -> None:
        cu_top = outputs.logprobs.cu_top.tolist()
        for entry, row in enumerate(outputs.logprobs.rows.tolist()):
            top = outputs.logprobs.top_token_ids[cu_top[entry]:cu_top[entry + 1]].tolist()
            self.logprobs.setdefault(keys[row], []).append(
                (int(outputs.logprobs.positions[entry]), int(outputs.logprobs.token_ids[entry]),
                 float(outputs.logprobs.logprobs[entry]), top))
            self.ranks.setdefault(keys[row], []).append(int(outputs.logprobs.ranks[entry]))

    def check_all_finished(self) -> None:
        """Every choice that was ever named has its terminal output and a FINISHED event."""
        for key, kinds in self.events.items():
            assert key in self.finish_reasons, f"{key} never finished"
            assert kinds[-1] == EVENT_FINISHED, f"{key} events {kinds} do not end with FINISHED"


TEST_CONFIG = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                           eos_token_ids=(2,), vocab_size=1000)


class Harness:
    """An engine, a fake worker and an output log, stepped synchronously with every invariant
    checked after every operation."""

    def __init__(self, num_blocks: int = 64, scripts: dict[str, Sequence[int]] | None = None,
                 **config_changes: object) -> None:
        self.config = TEST_CONFIG.with_updates(**config_changes)
        self.engine = SchedulerEngine(self.config, num_blocks, rng=random.Random(0))
        self.worker = FakeWorker(num_blocks, self.config.block_size, scripts)
        self.log = OutputLog()

    def add(self, request_id: str, prompt: int | Sequence[int], **params: object) -> None:
        """Add a request; an int prompt means that many distinct-looking prompt tokens."""
        if isinstance(prompt, int):
            prompt = 100 + np.arange(prompt) % 800
        prompt_ids = np.asarray(prompt, dtype=np.int32)  # int32 [num_prompt_tokens]
        params.setdefault("temperature", 0.0)
        for choice_index in range(int(params.get("n", 1))):
            self.worker.expect(choice_key(request_id, choice_index), prompt_ids.tolist())
        self.engine.add(AddRequest(request_id, prompt_ids, SamplingParams(**params), time.time()))
        self.engine.check_invariants()

    def abort(self, *request_ids: str, choice_index: int = ALL_CHOICES) -> None:
        """Abort `choice_index` (default: every choice) of each request."""
        self.engine.abort(list(request_ids), [choice_index] * len(request_ids))
        self.engine.check_invariants()

    def step(self) -> StepPlan | None:
        """One loop iteration: flush step-less outputs, schedule, run the fake worker, apply."""
        pending = self.engine.drain_outputs()
        if pending is not None:
            self.log.record(pending)
        plan = self.engine.schedule()
        self.engine.check_invariants()
        if plan is None:
            return None
        assert int(plan.num_scheduled_tokens.sum()) <= self.config.max_num_batched_tokens
        assert plan.num_seqs <= self.config.max_num_seqs
        self.log.record(self.engine.apply_result(self.worker(plan)))
        self.engine.check_invariants()
        return plan

    def run(self, max_steps: int = 10_000) -> list[StepPlan]:
        """Step until nothing is left to compute; the plans, in order."""
        plans = []
        for _ in range(max_steps):
            plan = self.step()
            if plan is None:
                assert not self.engine.has_unfinished_requests, "idle with unfinished requests"
                self.log.record(self.engine.heartbeat())  # events of the last idle transitions
                self.log.check_all_finished()
                return plans
            plans.append(plan)
        raise AssertionError(f"still running after {max_steps} steps")
