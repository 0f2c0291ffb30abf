"""allowed_token_ids and bad_words: mask rows at every sampling step, under preemption and n, and beside a grammar."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from test_structured_output import SPEC, VOCAB, add, assert_valid, make_harness

from proto.errors import ValidationError
from proto.messages import ERROR_INVALID_REQUEST, AddRequest, ResumedOutputs
from proto.sampling import SamplingParams
from scheduler_fakes import Harness
from scheduler_proc.bad_words import BadWords
from scheduler_proc.token_set import TokenSet, allowed_row

ALLOWED = (7, 31, 32, 33, 64, 511, VOCAB - 1)


def test_an_allowed_row_sets_exactly_the_listed_bits_in_the_workers_layout() -> None:
    row = allowed_row([*ALLOWED, 7], VOCAB)  # a repeated id changes nothing
    assert row.shape == (-(-VOCAB // 32),) and row.dtype == np.int32 and not row.flags.writeable
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB]
    assert np.flatnonzero(bits).tolist() == sorted(ALLOWED)
    token_set = TokenSet(row)
    assert [t for t in range(VOCAB + 40) if token_set.allows(t)] == sorted(ALLOWED)


def test_a_token_outside_the_set_is_an_error_naming_it_and_sticks() -> None:
    token_set = TokenSet(allowed_row(ALLOWED, VOCAB))
    token_set.accept(31)
    assert token_set.error == ""
    token_set.accept(30)
    token_set.accept(31)
    assert token_set.error == "token 30 was sampled outside allowed_token_ids" and not token_set.is_finished


def test_every_sampled_token_is_allowed_and_only_sampling_rows_carry_the_mask(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    harness = make_harness(tokenizer_dir, backend, max_num_batched_tokens=8)  # a prompt over several chunks
    add(harness, "r", 20, None, allowed_token_ids=ALLOWED, max_tokens=40, ignore_eos=True)
    add(harness, "free", 6, None, max_tokens=30)
    plans = harness.run()
    assert harness.log.finish_reasons == {"r": "length", "free": "length"}
    assert set(harness.log.tokens["r"]) <= set(ALLOWED) and len(set(harness.log.tokens["r"])) > 1
    assert not set(harness.log.tokens["free"]) <= set(ALLOWED)
    expected = allowed_row(ALLOWED, VOCAB)
    for plan in plans:
        members = plan.request_ids
        rows = plan.grammar.rows.tolist()
        samples_r = "r" in members and bool(plan.sample_mask[members.index("r")])
        assert rows == ([members.index("r")] if samples_r else []), (members, rows)
        if rows:
            assert (plan.grammar.matrix.reshape(len(rows), -1)[0] == expected).all()
    assert not harness.engine.constraints.is_built  # no grammar engine for a token set


def test_siblings_share_the_set_and_preemption_keeps_their_output(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    outputs, preemptions = {}, {}
    for num_blocks in (64, 20):  # roomy, then too few blocks for all three: some are preempted and recomputed
        harness = make_harness(tokenizer_dir, backend, num_blocks=num_blocks)
        add(harness, "r", 10, None, n=3, temperature=1.0, seed=3, allowed_token_ids=ALLOWED,
            max_tokens=30, ignore_eos=True)
        harness.run()
        outputs[num_blocks] = dict(harness.log.tokens)
        preemptions[num_blocks] = harness.engine.queues.num_preemptions_total
        assert set(harness.log.finish_reasons.values()) == {"length"}, harness.log.error_messages
        assert all(set(tokens) <= set(ALLOWED) for tokens in harness.log.tokens.values())
    assert preemptions[64] == 0 and preemptions[20] > 0
    assert outputs[20] == outputs[64]
    assert len({tuple(tokens) for tokens in outputs[64].values()}) == 3


def test_allowed_token_ids_beside_a_grammar_keep_its_output_valid_and_inside_the_set(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    alone = make_harness(tokenizer_dir, backend)
    add(alone, "g", 5, SPEC)
    alone.run()
    output = alone.log.tokens["g"]
    matcher, row = alone.engine.constraints.start(SPEC, 1)[0][0], np.empty(-(-VOCAB // 32), dtype=np.int32)
    for token in output:  # a pick the grammar made once, among others: taken away, the output changes
        matcher.fill_row(row)
        if VOCAB - len(disallowed(row)) > 1 and output.count(token) == 1:
            first = token
            break
        matcher.advance(token)
    allowed = tuple(t for t in range(VOCAB) if t != first)
    harness = make_harness(tokenizer_dir, backend)
    add(harness, "both", 5, SPEC, allowed_token_ids=allowed)
    harness.run()
    assert harness.log.finish_reasons == {"both": "stop"}
    assert_valid(backend, harness.log.tokens["both"])
    assert first not in harness.log.tokens["both"]


def test_bad_words_mask_the_token_that_would_complete_one(tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    a, b = 300, 301
    harness = make_harness(tokenizer_dir, backend)
    # Allowed only a and b; "a b" and "b b" banned: after the first token, b can never follow.
    add(harness, "r", 5, None, allowed_token_ids=(a, b), bad_words_token_ids=((a, b), (b, b)),
        max_tokens=40, ignore_eos=True, temperature=1.0, seed=1)
    add(harness, "one", 5, None, allowed_token_ids=(a, b), bad_words_token_ids=((b,),), max_tokens=10,
        ignore_eos=True)
    harness.run()
    tokens = harness.log.tokens["r"]
    assert tokens[0] in (a, b) and tokens[1:] == [a] * 39
    assert harness.log.tokens["one"] == [a] * 10


def test_bad_words_follow_the_output_not_the_prompt_and_replay_restored_tokens() -> None:
    bad = BadWords([(5, 6, 7), (9,)], VOCAB)
    row = np.empty(-(-VOCAB // 32), dtype=np.int32)
    bad.fill_row(row)
    assert disallowed(row) == [9]
    for token in (5, 6):
        bad.accept(token)
    bad.fill_row(row)
    assert disallowed(row) == [7, 9] and bad.error == ""
    bad.accept(7)
    assert bad.error == "token 7 completes one of bad_words"
    restored = BadWords([(5, 6, 7)], VOCAB, output_token_ids=[1, 5, 6])
    assert restored.banned_next() == [7]


def disallowed(row: np.ndarray) -> list[int]:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB] == 0).tolist()


def test_without_the_vocabulary_size_allowed_token_ids_fail_and_others_run() -> None:
    harness = Harness(vocab_size=0)  # a scheduler told no vocabulary
    harness.engine.add(AddRequest("a", np.arange(5, dtype=np.int32) + 1, SamplingParams(allowed_token_ids=(3,)),
                                  time.time()))
    add(harness, "u", 5, None, max_tokens=3)
    harness.run()
    assert harness.log.finish_reasons == {"a": "error", "u": "length"}
    assert "vocabulary size" in harness.log.error_messages["a"]


@pytest.mark.parametrize("ids, message", [((5, -1), "non-negative integers, got -1"), ((True,), "got True"),
                                          ((0,) * (2**18 + 1), "at most 262144 allowed_token_ids")])
def test_sampling_params_check_allowed_token_ids(ids: tuple, message: str) -> None:
    with pytest.raises(ValidationError, match="allowed_token_ids") as error:
        SamplingParams(allowed_token_ids=ids)
    assert message in str(error.value)


def test_the_vocabulary_bounds_allowed_token_ids() -> None:
    SamplingParams(allowed_token_ids=(0, VOCAB - 1)).check_vocab(VOCAB)
    with pytest.raises(ValidationError, match=f"allowed_token_ids token id {VOCAB} is out of range"):
        SamplingParams(allowed_token_ids=(0, VOCAB)).check_vocab(VOCAB)


def test_a_resubmitted_requests_bad_words_continue_from_each_choices_restored_tokens() -> None:
    harness = Harness()
    resume = ResumedOutputs(np.array([0, 2, 5], np.int32), np.array([5, 6, 1, 5, 9], np.int32),
                            np.array([False, False]))
    params = SamplingParams(n=2, max_tokens=20, bad_words_token_ids=((5, 6, 7), (5, 9, 8)))
    harness.engine.add(AddRequest("r", np.arange(1, 6, dtype=np.int32), params, time.time(), resume=resume))
    first, second = (harness.engine.get_request("r", index) for index in (0, 1))
    assert first.grammar.banned_next() == [7] and second.grammar.banned_next() == [8]


@pytest.mark.parametrize("params, message", [
    ({"allowed_token_ids": (5, 6), "bad_words_token_ids": ((5,), (6,))}, "also one of bad_words"),
    ({"allowed_token_ids": (2, 7), "stop_token_ids": (7,), "min_tokens": 1}, "holds only stop tokens"),
])
def test_an_allowed_set_that_leaves_nothing_to_sample_is_refused_as_invalid(params: dict, message: str) -> None:
    harness = Harness()  # its model's EOS is token 2
    harness.engine.add(AddRequest("r", np.arange(1, 6, dtype=np.int32), SamplingParams(max_tokens=5, **params),
                                  time.time()))
    outputs = harness.engine.drain_outputs()
    assert outputs is not None and outputs.finish_reasons == ["error"]
    assert message in outputs.error_messages[0] and outputs.error_codes.tolist() == [ERROR_INVALID_REQUEST]


def test_a_grammar_whose_only_continuation_is_banned_ends_in_an_error_saying_so(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    alone = make_harness(tokenizer_dir, backend)
    add(alone, "g", 5, SPEC)
    alone.run()
    forced = alone.log.tokens["g"][0]  # a JSON object's opening brace: nothing else may start it
    harness = make_harness(tokenizer_dir, backend)
    add(harness, "g", 5, SPEC, bad_words_token_ids=((forced,),))
    harness.run()
    assert harness.log.finish_reasons == {"g": "error"}
    assert "leave no token to sample" in harness.log.error_messages["g"]


def test_resumed_tokens_that_hold_a_bad_word_end_the_request_at_once() -> None:
    harness = Harness()
    resume = ResumedOutputs(np.array([0, 2], np.int32), np.array([5, 6], np.int32), np.array([False]))
    params = SamplingParams(max_tokens=20, bad_words_token_ids=((5, 6),))
    harness.engine.add(AddRequest("r", np.arange(1, 6, dtype=np.int32), params, time.time(), resume=resume))
    outputs = harness.engine.drain_outputs()
    assert outputs is not None and outputs.finish_reasons == ["error"]
    assert "resumed output tokens hold one of its bad_words" in outputs.error_messages[0]
