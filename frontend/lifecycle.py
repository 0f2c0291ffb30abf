"""Request phase durations (queue, prefill, decode, inference) from the scheduler's lifecycle events.

Every difference is between two timestamps of the SCHEDULER's clock: the frontend's own clock
never enters, so clock offsets between processes cannot skew these durations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.messages import (EVENT_FINISHED, EVENT_FIRST_TOKEN, EVENT_QUEUED, EVENT_SCHEDULED,
                            StepOutputs)


@dataclass(frozen=True)
class PhaseDurations:
    """One finished choice's phases; None when the choice never reached the phase's start or end."""

    queue_s: float | None  # first SCHEDULED - QUEUED
    prefill_s: float | None  # FIRST_TOKEN - first SCHEDULED
    decode_s: float | None  # FINISHED - FIRST_TOKEN
    inference_s: float | None  # FINISHED - first SCHEDULED (prefill and decode, preemptions included)


@dataclass
class _RequestEvents:
    queued_s: float | None = None  # the first QUEUED of any choice (siblings are queued together)
    choices: dict[int, dict[int, float]] = field(default_factory=dict)  # choice -> kind -> first time


class LifecycleTracker:
    """Keeps the first time of each event kind per (request, choice) until the choice's FINISHED.

    A preempted choice is scheduled again later; its phases still run from the FIRST scheduling
    and the first token, as vLLM measures them.
    """

    def __init__(self) -> None:
        self._requests: dict[str, _RequestEvents] = {}

    def observe(self, outputs: StepOutputs) -> list[PhaseDurations]:
        """Record this message's events; return the durations of the choices that finished."""
        finished = []
        events = outputs.events
        events = zip(events.request_ids, events.choice_indices.tolist(), events.kinds.tolist(),
                     events.times_s.tolist())
        for request_id, choice, kind, time_s in events:
            request = self._requests.setdefault(request_id, _RequestEvents())
            times = request.choices.setdefault(choice, {})
            times.setdefault(kind, time_s)
            if kind == EVENT_QUEUED and request.queued_s is None:
                request.queued_s = time_s
            if kind == EVENT_FINISHED:
                finished.append(_durations(times, request.queued_s))
                del request.choices[choice]
                if not request.choices:
                    del self._requests[request_id]
        return finished


def _durations(times: dict[int, float], request_queued_s: float | None) -> PhaseDurations:
    queued = times.get(EVENT_QUEUED, request_queued_s)
    scheduled = times.get(EVENT_SCHEDULED)
    first_token = times.get(EVENT_FIRST_TOKEN)
    finished = times[EVENT_FINISHED]
    return PhaseDurations(
        queue_s=_between(queued, scheduled),
        prefill_s=_between(scheduled, first_token),
        decode_s=_between(first_token, finished),
        inference_s=_between(scheduled, finished),
    )


def _between(start_s: float | None, end_s: float | None) -> float | None:
    if start_s is None or end_s is None:
        return None
    return max(0.0, end_s - start_s)  # the scheduler's wall clock may step back (NTP)
