"""The real scheduler loop in a thread over real ZMQ ipc sockets, with a fake worker per rank and a
fake frontend: the harness of the loop tests."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import zmq

from proto import codec, sockets
from proto.messages import AddRequest, StepOutputs, StepPlan, StepResult, WorkerReady
from proto.sampling import SamplingParams
from scheduler_fakes import TEST_CONFIG, FakeWorker, OutputLog, choice_key
from scheduler_proc.loop import SchedulerLoop

NUM_BLOCKS = 64


class WorkerThread:
    """A rank that connects like a real worker, reports ready, and answers plans with FakeWorker."""

    def __init__(self, context: zmq.Context, runtime_dir: str, rank: int = 0, answers: bool = True,
                 error: str = "", expected: FakeWorker | None = None, generation: int = 0,
                 dtype: str = "float32", num_blocks: int = NUM_BLOCKS) -> None:
        """expected: a lost worker whose requests this one (its replacement) continues;
        generation: the worker group it reports (a replacement's is above the lost one's);
        num_blocks: the KV blocks it reports ready with."""
        self.fake = FakeWorker(NUM_BLOCKS, TEST_CONFIG.block_size)
        if expected is not None:
            self.fake.sequences = {key: list(tokens) for key, tokens in expected.sequences.items()}
            self.fake.prompt_lengths = dict(expected.prompt_lengths)
        self.plans = sockets.connect(context, zmq.PULL, runtime_dir, sockets.plan_channel(rank))
        self.results = sockets.connect(context, zmq.PUSH, runtime_dir, sockets.RESULTS)
        self.rank, self.answers, self.error, self.generation, self.dtype = rank, answers, error, generation, dtype
        self.num_blocks = num_blocks
        self.plan_generations: list[int] = []  # StepPlan.generation of every plan it got
        self.noise_before_next_result: list[bytes] = []  # frames sent just before the next result
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        dtype, _, kv_cache_dtype = self.dtype.partition("/")  # "float32/bfloat16": a bf16 KV cache
        sockets.send(self.results, WorkerReady(self.rank, self.num_blocks, os.getpid(), self.generation, dtype,
                                               kv_cache_dtype or dtype))
        while not self._stop.is_set():
            frame = sockets.recv_ready(self.plans, 0.05)
            if frame is None or not self.answers:
                continue
            plan = codec.decode(frame, StepPlan)
            self.plan_generations.append(plan.generation)
            if self.rank:  # only rank 0 returns tokens; the others acknowledge the step
                result = StepResult(plan.step_id, np.empty(0, np.int32), self.error, rank=self.rank)
            else:
                result = self.fake(plan)
            noise, self.noise_before_next_result = self.noise_before_next_result, []
            for frame in noise:
                self.results.send(frame)
            sockets.send(self.results, result)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.plans.close()
        self.results.close()


class Frontend:
    """Sends requests and collects outputs, checking each request ends exactly once."""

    def __init__(self, context: zmq.Context, runtime_dir: str, worker: WorkerThread | None) -> None:
        self.requests = sockets.connect(context, zmq.PUSH, runtime_dir, sockets.REQUESTS)
        self.outputs = sockets.connect(context, zmq.PULL, runtime_dir, sockets.OUTPUTS)
        self.log = OutputLog()
        self.worker = worker  # rank 0, whose FakeWorker checks every plan
        self.workers: list[WorkerThread] = []  # every rank running_loop started

    def add(self, request_id: str, num_prompt: int, max_tokens: int, n: int = 1) -> None:
        prompt = (100 + np.arange(num_prompt)).astype(np.int32)
        if self.worker is not None:
            for choice_index in range(n):
                self.worker.fake.expect(choice_key(request_id, choice_index), prompt.tolist())
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)
        sockets.send(self.requests, AddRequest(request_id, prompt, params, time.time()))

    def receive(self, timeout_s: float = 5.0) -> StepOutputs:
        frame = sockets.recv_ready(self.outputs, timeout_s)
        assert frame is not None, f"no output within {timeout_s} s"
        outputs = codec.decode(frame, StepOutputs)
        self.log.record(outputs)
        return outputs

    def wait_finished(self, *request_ids: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not set(request_ids) <= set(self.log.finish_reasons):
            self.receive(max(deadline - time.monotonic(), 0.01))

    def close(self) -> None:
        self.requests.close()
        self.outputs.close()


@contextmanager
def running_loop(silent_ranks: tuple[int, ...] = (), failing_ranks: tuple[int, ...] = (),
                 **config_changes: object) -> Iterator[tuple[SchedulerLoop, Frontend, zmq.Socket]]:
    """A SchedulerLoop in a thread with a fake worker per rank (silent_ranks never answer a
    step, failing_ranks answer with an error), a fake frontend and the control socket."""
    runtime_dir = sockets.make_runtime_dir()
    context = zmq.Context()
    control = sockets.bind(context, zmq.PULL, runtime_dir, sockets.CONTROL)
    config = TEST_CONFIG.with_updates(runtime_dir=runtime_dir, **config_changes)
    loop = SchedulerLoop(config)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    workers = [WorkerThread(context, runtime_dir, rank, answers=rank not in silent_ranks,
                            error="boom" if rank in failing_ranks else "")
               for rank in range(config.tensor_parallel_size)]
    frontend = Frontend(context, runtime_dir, workers[0])
    frontend.workers = workers
    try:
        yield loop, frontend, control
    finally:
        loop.request_stop()
        thread.join(timeout=5)
        assert not thread.is_alive(), "the loop did not stop"
        for closable in (frontend, *workers, control):
            closable.close()
        context.term()
        shutil.rmtree(runtime_dir, ignore_errors=True)
