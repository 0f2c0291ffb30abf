"""proto: AddRequest carries its GrammarSpec, StepPlan its GrammarMasks; garbage in either is a ProtocolError."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from proto import codec, messages
from proto.errors import ProtocolError
from proto.grammar import GrammarSpec
from proto.sampling import SamplingParams
from proto.sampling_columns import SamplingColumns


def _add(grammar: GrammarSpec | None) -> messages.AddRequest:
    return messages.AddRequest("r", np.array([1, 2, 3], dtype=np.int32), SamplingParams(), 1.5, grammar)


def _plan(sample_mask: list[bool], masks: messages.GrammarMasks) -> messages.StepPlan:
    n = len(sample_mask)
    i32 = lambda values: np.asarray(values, dtype=np.int32)  # noqa: E731
    return messages.StepPlan(
        step_id=3, request_ids=[f"r{i}" for i in range(n)], input_ids=i32(range(n)),
        num_computed_tokens=i32([4] * n), num_scheduled_tokens=i32([1] * n), cu_block_ids=i32(range(n + 1)),
        block_ids=i32(range(n)), sample_mask=np.array(sample_mask), grammar=masks,
        sampling=SamplingColumns.of_params([SamplingParams()] * n))


def _masks(rows: list[int], words: int, num_words: int | None = None) -> messages.GrammarMasks:
    num_words = len(rows) * words if num_words is None else num_words
    return messages.GrammarMasks(np.array(rows, dtype=np.int32), words,
                                 np.arange(num_words, dtype=np.int32) - 5)


@pytest.mark.parametrize("grammar", [None, GrammarSpec.json_schema({"type": "object"}),
                                     GrammarSpec.choice(["yes", "no"]), GrammarSpec("regex", "[a-z]+/x")])
def test_an_add_request_round_trips_with_or_without_its_grammar(grammar: GrammarSpec | None) -> None:
    assert codec.decode(codec.encode(_add(grammar)), messages.AddRequest).grammar == grammar


@pytest.mark.parametrize("fields, match", [(["bad", "x"], "grammar kind must be one of"),
                                          (["regex", ""], "must not be empty"),
                                          (["choice", "[1]"], "JSON array of strings"),
                                          (["choice", "[" * 50_000], "JSON array of strings"),  # too deep
                                          (["regex", 5], "must be str"), (["regex"], "needs 2 fields")])
def test_a_garbage_grammar_spec_is_a_protocol_error(fields: list, match: str) -> None:
    values = msgpack.unpackb(codec.encode(_add(GrammarSpec("regex", "a"))))
    names = [f.name for f in dataclasses.fields(messages.AddRequest)]
    values[1 + names.index("grammar")] = fields  # after the tag
    with pytest.raises(ProtocolError, match=match):
        codec.decode(msgpack.packb(values), messages.AddRequest)


def test_a_plan_round_trips_its_masks_and_an_unconstrained_one_carries_none() -> None:
    plan = _plan([True, False, True], _masks([2, 0], 3))
    decoded = codec.decode(codec.encode(plan), messages.StepPlan)
    assert decoded.grammar.rows.tolist() == [2, 0] and decoded.grammar.words == 3
    assert decoded.grammar.matrix.tolist() == plan.grammar.matrix.tolist()
    assert len(codec.decode(codec.encode(_plan([True], messages.GrammarMasks())), messages.StepPlan).grammar) == 0


@pytest.mark.parametrize("masks, match", [
    (_masks([3], 2), "rows out of range"), (_masks([-1], 2), "rows out of range"),
    (_masks([0, 0], 2), "repeats a member"), (_masks([1], 2), "does not sample"),
    (_masks([0], 2, num_words=3), "needs 1 rows of 2 words"), (_masks([0], 0), "words > 0"),
    (_masks([], 2, num_words=2), "needs 0 rows of 2 words"),
])
def test_garbage_masks_are_a_protocol_error(masks: messages.GrammarMasks, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        codec.decode(codec.encode(_plan([True, False, True], masks)), messages.StepPlan)


def test_masks_of_another_width_than_the_bitmask_are_rejected_before_reshaping() -> None:
    plan = dataclasses.replace(_plan([True], _masks([0], 2)), grammar=_masks([0], 4, num_words=2))
    with pytest.raises(ProtocolError, match="needs 1 rows of 4 words"):
        codec.decode(codec.encode(plan), messages.StepPlan)
