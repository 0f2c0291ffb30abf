"""The generations of one HTTP request: one per prompt of a completions batch, its choices numbered across them.

OpenAI's (and vLLM's) /v1/completions take a list of prompts; choice `index` is then
prompt_index * n + choice_index. Each prompt runs as its own engine request (so the scheduler
batches, caches and preempts them as any others); the response fails as a whole if one of them
fails, and the others are aborted at once. A single prompt, and every chat request, is a batch of one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

from frontend.choice import ChoiceDelta, ChoiceOutput
from frontend.generation import Generation
from proto.messages import FinishReason


class GenerationBatch:
    """Invariant: when `deltas()` ends or `close()` returns, every generation has ended (each
    leaves nothing running in the scheduler, see Generation)."""

    def __init__(self, request_id: str, generations: list[Generation]) -> None:
        """`request_id`: the response's id; each generation carries its own engine request id."""
        self.request_id = request_id
        self.generations = generations
        self.created_s = generations[0].created_s
        self._pumps: list[asyncio.Task] = []  # deltas() of several generations: one reader task each
        self._offsets = {g: i * g.job.sampling_params.n for i, g in enumerate(generations)}

    @property
    def num_prompt_tokens(self) -> int:
        return sum(g.num_prompt_tokens for g in self.generations)

    @property
    def num_cached_tokens(self) -> int:
        return sum(g.num_cached_tokens for g in self.generations)

    @property
    def num_output_tokens(self) -> int:
        """Completion tokens of every choice; none when only the prompts are echoed (scored)."""
        if self.generations[0].job.echo_only:
            return 0
        return sum(g.num_output_tokens for g in self.generations)

    @property
    def failed(self) -> Generation | None:
        """The generation whose failure the response reports, if one failed: the first that ended
        with "error" (a refusal or a fault; the others were aborted for it), else the first abort."""
        failed = [g for g in self.generations if g.failure is not None]
        errors = [g for g in failed if (f := g.failure) is not None and f.finish_reason == FinishReason.ERROR]
        return (errors or failed or [None])[0]

    def offset(self, generation: Generation) -> int:
        """Its first choice's index in the response."""
        return self._offsets[generation]

    def choices(self) -> Iterator[tuple[Generation, ChoiceOutput, int]]:
        """Every choice with its generation and its index in the response, in that order."""
        for generation in self.generations:
            first = self.offset(generation)
            for choice in generation.choices:
                yield generation, choice, first + choice.index

    def abort(self, message: str = "") -> None:
        for generation in self.generations:
            generation.abort(message)

    async def start(self) -> None:
        """Send every prompt; return once the scheduler has queued each or refused one (then the
        others are aborted and `failed` says why). An exception (EngineUnavailableError) aborts
        them all and is raised once every start has ended, so nothing else still runs them."""
        outcomes = await asyncio.gather(*(g.start() for g in self.generations), return_exceptions=True)
        raised = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if raised is not None or self.failed is not None:
            self.abort()
        if raised is not None:
            raise raised

    async def run(self) -> None:
        """Run every generation to its end; one that fails aborts the others."""
        async for _ in self.deltas():
            pass

    async def deltas(self) -> AsyncIterator[tuple[Generation, ChoiceDelta]]:
        """Each generation's deltas as they come, with the generation they belong to."""
        if len(self.generations) == 1:  # no task or queue for the common case
            only = self.generations[0]
            async for delta in only.deltas():
                yield only, delta
            return
        queue: asyncio.Queue[tuple[Generation, ChoiceDelta | BaseException | None]] = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(g, queue)) for g in self.generations]
        try:
            for _ in range(len(self._pumps)):
                while (item := await queue.get())[1] is not None:
                    generation, delta = item
                    if isinstance(delta, BaseException):
                        raise delta
                    yield generation, delta
                    if delta.finish_reason and generation.failure is not None:
                        self.abort()
        finally:
            await self.close()

    async def _pump(self, generation: Generation,
                    queue: asyncio.Queue[tuple[Generation, ChoiceDelta | BaseException | None]]) -> None:
        """One generation's deltas into the queue; what it raises goes there too, for deltas() to
        raise (which aborts the others)."""
        try:
            async for delta in generation.deltas():
                await queue.put((generation, delta))
        except Exception as exc:  # not CancelledError: close() cancels the pumps
            await queue.put((generation, exc))
        finally:
            await queue.put((generation, None))

    async def close(self) -> None:
        """The batch's one way to end: what still runs is aborted, the pumps (the only readers of
        the generations' streams) are stopped first, then every generation is closed. Idempotent."""
        self.abort()
        pumps, self._pumps = self._pumps, []
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for generation in self.generations:
            await generation.close()
