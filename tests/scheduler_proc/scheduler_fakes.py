"""Fakes for scheduler tests: a scripted worker with a token-id "KV cache", and an engine harness."""

from __future__ import annotations

import random
import time
import zlib
from collections.abc import Sequence

import numpy as np

from proto import codec
from proto.config import EngineConfig
from proto.messages import AddRequest, StepOutputs, StepPlan, StepResult
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
        plan = codec.decode(codec.encode(plan))  # the worker only ever sees the decoded plan
        self.plans.append(plan)
        if self.fail_next_step:
            error, self.fail_next_step = self.fail_next_step, ""
            return StepResult(plan.step_id, np.empty(0, dtype=np.int32), error)
        sampled = []
        offsets = np.concatenate([[0], np.cumsum(plan.num_scheduled_tokens)])
        for row, request_id in enumerate(plan.request_ids):
            start = int(plan.num_computed_tokens[row])
            end = start + int(plan.num_scheduled_tokens[row])
            table = plan.block_ids[plan.cu_block_ids[row]:plan.cu_block_ids[row + 1]]
            self.kv_slots[self._slots(table, start, end)] = plan.input_ids[offsets[row]:offsets[row + 1]]
            if plan.sample_mask[row]:
                sampled.append(self._sample(plan, row, request_id, table, end))
        return StepResult(plan.step_id, np.array(sampled, dtype=np.int32), "")

    def _slots(self, table: np.ndarray, start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        assert end <= len(table) * self.block_size, f"block table too short for position {end - 1}"
        return table[positions // self.block_size].astype(np.int64) * self.block_size + positions % self.block_size

    def _sample(self, plan: StepPlan, row: int, request_id: str, table: np.ndarray, end: int) -> int:
        sequence = self.sequences[request_id]
        cached = self.kv_slots[self._slots(table, 0, end)]
        assert cached.tolist() == sequence[:end], f"KV of {request_id} corrupted before position {end}"
        token = self._scripted(request_id, end)
        banned = plan.bias_token_ids[(plan.bias_rows == row) & np.isneginf(plan.bias_values)]
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


class OutputLog:
    """Every StepOutputs the engine produced, checked on arrival: at most one terminal output per
    request and nothing after it."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.error_messages: dict[str, str] = {}
        self.messages: list[StepOutputs] = []

    def record(self, outputs: StepOutputs) -> None:
        outputs = codec.decode(codec.encode(outputs))
        self.messages.append(outputs)
        for index, request_id in enumerate(outputs.request_ids):
            assert request_id not in self.finish_reasons, f"{request_id} got an output after finishing"
            self.tokens.setdefault(request_id, []).extend(outputs.tokens_of(index).tolist())
            if outputs.finish_reasons[index]:
                self.finish_reasons[request_id] = outputs.finish_reasons[index]
                self.error_messages[request_id] = outputs.error_messages[index]


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
        self.worker.expect(request_id, prompt_ids.tolist())
        self.engine.add(AddRequest(request_id, prompt_ids, SamplingParams(**params), time.time()))
        self.engine.check_invariants()

    def abort(self, *request_ids: str) -> None:
        self.engine.abort(list(request_ids))
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
                return plans
            plans.append(plan)
        raise AssertionError(f"still running after {max_steps} steps")
