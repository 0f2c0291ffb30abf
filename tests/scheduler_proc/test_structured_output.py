"""Structured output through the engine: each constrained choice owns a matcher, its sampling row
gets a bitmask, and its output validates whatever happens meanwhile (batch-mates, n > 1,
preemption and recompute, a lost worker group); a grammar failure is an "error", never a hang."""

from __future__ import annotations

import json
import random
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from proto.grammar import GrammarSpec
from proto.messages import AddRequest, ResumedOutputs, StepPlan
from proto.sampling import SamplingParams
from scheduler_fakes import FakeWorker, Harness, choice_key
from scheduler_proc.constraints import NO_MASKS

VOCAB = 520  # the tiny tokenizer has 512 tokens; the model's logits are wider
SCHEMA = {"type": "object",
          "properties": {"role": {"enum": ["admin", "user"]}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3}},
          "required": ["role", "ok", "tags"], "additionalProperties": False}
SPEC = GrammarSpec.json_schema(SCHEMA)


class GrammarWorker(FakeWorker):
    """A fake rank 0 that samples a constrained row uniformly among its allowed tokens (a pure
    function of the row's name and position); `ignores_masks`: a broken sampler that does not."""

    ignores_masks = False

    def _sample(self, plan: StepPlan, row: int, request_id: str, table: np.ndarray, end: int) -> int:
        rows = plan.grammar.rows.tolist()
        if row not in rows or self.ignores_masks:
            return super()._sample(plan, row, request_id, table, end)
        bits = np.unpackbits(plan.grammar.matrix[rows.index(row)].view(np.uint8), bitorder="little")[:VOCAB]
        allowed = np.flatnonzero(bits)
        token = int(allowed[random.Random(zlib.crc32(f"{request_id}:{end}".encode())).randrange(len(allowed))])
        sequence = self.sequences[request_id]
        assert self.kv_slots[self._slots(table, 0, end)].tolist() == sequence[:end]
        if end == len(sequence):
            sequence.append(token)
        return token


def make_harness(tokenizer_dir: Path, backend: tokenizers.Tokenizer, num_blocks: int = 64,
                 **changes: object) -> Harness:
    harness = Harness(num_blocks=num_blocks, model=str(tokenizer_dir), vocab_size=VOCAB,
                      eos_token_ids=(backend.token_to_id("<|im_end|>"),), **changes)
    harness.worker = GrammarWorker(num_blocks, harness.config.block_size)
    return harness


def add(harness: Harness, request_id: str, prompt_len: int, grammar: GrammarSpec | None = SPEC,
        **params: object) -> None:
    prompt = (100 + np.arange(prompt_len) % 400).astype(np.int32)
    params.setdefault("max_tokens", 120)
    for choice_index in range(int(params.get("n", 1))):
        harness.worker.expect(choice_key(request_id, choice_index), prompt.tolist())
    harness.engine.add(AddRequest(request_id, prompt, SamplingParams(**params), time.time(), grammar))
    harness.engine.check_invariants()


def assert_valid(backend: tokenizers.Tokenizer, token_ids: list[int]) -> dict:
    document = json.loads(backend.decode(token_ids, skip_special_tokens=False))
    assert set(document) == {"role", "ok", "tags"} and list(document) == ["role", "ok", "tags"]
    assert document["role"] in ("admin", "user") and isinstance(document["ok"], bool)
    assert len(document["tags"]) <= 3 and all(tag in ("a", "bc") for tag in document["tags"])
    return document


def test_a_constrained_request_stops_with_output_that_validates_against_its_schema(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    harness = make_harness(tokenizer_dir, backend, max_num_batched_tokens=8)  # a prompt over several chunks
    add(harness, "r", 20)
    plans = harness.run()
    assert harness.log.finish_reasons["r"] == "stop"
    assert_valid(backend, harness.log.tokens["r"])
    chunks = [plan for plan in plans if not plan.sample_mask[0]]
    assert chunks and all(len(plan.grammar) == 0 for plan in chunks)  # a chunk that does not sample gets no row
    assert all(len(plan.grammar) == 1 for plan in plans if plan.sample_mask[0])


def test_constrained_and_unconstrained_rows_share_a_batch_each_as_it_runs_alone(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    alone = {}
    for request_id, grammar in (("json", SPEC), ("free", None)):
        harness = make_harness(tokenizer_dir, backend)
        add(harness, request_id, 6, grammar, max_tokens=120 if grammar else 30)
        harness.run()
        alone[request_id] = harness.log.tokens[request_id]
    harness = make_harness(tokenizer_dir, backend)
    add(harness, "json", 6, SPEC)
    add(harness, "free", 6, None, max_tokens=30)
    plans = harness.run()
    assert any(plan.num_seqs == 2 and plan.grammar.rows.tolist() == [plan.request_ids.index("json")]
               for plan in plans)
    assert harness.log.tokens == alone
    assert harness.log.finish_reasons == {"json": "stop", "free": "length"}
    assert_valid(backend, alone["json"])


def test_every_sibling_of_an_n_request_owns_its_matcher_and_stops_valid(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    harness = make_harness(tokenizer_dir, backend)
    add(harness, "r", 10, n=3, temperature=1.0, seed=3)
    plans = harness.run()
    keys = ["r", "r#1", "r#2"]
    assert all(harness.log.finish_reasons[key] == "stop" for key in keys)
    documents = [assert_valid(backend, harness.log.tokens[key]) for key in keys]
    assert len({json.dumps(d) for d in documents}) > 1  # three matchers advanced on three streams
    assert max(len(plan.grammar) for plan in plans) == 3


def test_preemption_and_recompute_mid_output_keep_it_valid_and_unchanged(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    def workload(harness: Harness) -> None:
        for index in range(4):
            add(harness, f"c{index}", 9, max_tokens=60)
        add(harness, "u", 9, None, max_tokens=40)

    roomy = make_harness(tokenizer_dir, backend, num_blocks=200)
    workload(roomy)
    roomy.run()
    tight = make_harness(tokenizer_dir, backend, num_blocks=30, max_num_seqs=5)
    workload(tight)
    tight.run()
    assert tight.engine.queues.num_preemptions_total > 0 and roomy.engine.queues.num_preemptions_total == 0
    assert tight.log.tokens == roomy.log.tokens
    for index in range(4):
        assert tight.log.finish_reasons[f"c{index}"] == "stop"
        assert_valid(backend, tight.log.tokens[f"c{index}"])


@pytest.mark.parametrize("lost_after", [1, 4, 9])
def test_a_lost_worker_group_mid_output_keeps_the_matchers_and_the_output_valid(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer, lost_after: int) -> None:
    undisturbed = make_harness(tokenizer_dir, backend)
    add(undisturbed, "r", 9, n=2, temperature=1.0, seed=1)
    undisturbed.run()
    harness = make_harness(tokenizer_dir, backend)
    add(harness, "r", 9, n=2, temperature=1.0, seed=1)
    for _ in range(lost_after):
        harness.step()
    harness.engine.schedule()  # the step in flight when the group is lost
    harness.log.record(harness.engine.recover_lost_step())
    lost = harness.worker
    harness.worker = GrammarWorker(64, harness.config.block_size)
    harness.worker.sequences = {key: list(tokens) for key, tokens in lost.sequences.items()}
    harness.worker.prompt_lengths = dict(lost.prompt_lengths)
    harness.run()
    assert harness.log.tokens == undisturbed.log.tokens
    for key in ("r", "r#1"):
        assert harness.log.finish_reasons[key] == "stop"
        assert_valid(backend, harness.log.tokens[key])


def test_a_finished_grammar_stops_the_request_even_with_ignore_eos(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    harness = make_harness(tokenizer_dir, backend)
    add(harness, "r", 5, GrammarSpec.choice(["yes", "no"]), ignore_eos=True, max_tokens=50)
    harness.run()
    assert harness.log.finish_reasons["r"] == "stop"
    assert backend.decode(harness.log.tokens["r"]) in ("yes", "no")


def test_a_token_the_grammar_rejects_ends_the_request_with_an_error_naming_it(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    harness = make_harness(tokenizer_dir, backend)
    harness.worker.ignores_masks = True
    add(harness, "r", 5)
    add(harness, "u", 5, None, max_tokens=4)
    harness.run()
    assert harness.log.finish_reasons == {"r": "error", "u": "length"}
    assert "violates the grammar" in harness.log.error_messages["r"] and harness.log.tokens["r"] == []


def test_a_resubmission_whose_restored_tokens_break_its_grammar_ends_in_an_error_and_others_run(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    harness = make_harness(tokenizer_dir, backend)
    letters = backend.encode("abc").ids  # a replaced scheduler's frontend resubmits these for [0-9]{4}
    resume = ResumedOutputs(np.array([0, 0, len(letters)], np.int32), np.array(letters, np.int32),
                            np.array([False, False]))
    prompt = np.arange(100, 105, dtype=np.int32)
    harness.engine.add(AddRequest("r", prompt, SamplingParams(n=2, max_tokens=8), time.time(),
                                  GrammarSpec("regex", "[0-9]{4}"), resume))
    add(harness, "u", 5, None, max_tokens=3)
    harness.run()
    assert harness.log.finish_reasons == {"r": "error", "r#1": "error", "u": "length"}
    assert "choice 1's resumed output tokens do not match its grammar" in harness.log.error_messages["r"]
    harness.engine.check_invariants()


def test_a_grammar_the_scheduler_cannot_compile_ends_the_request_with_an_error(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    harness = make_harness(tokenizer_dir, backend)
    add(harness, "bad", 5, GrammarSpec("regex", "(unclosed"), n=2)
    harness.run()
    assert harness.log.finish_reasons == {"bad": "error", "bad#1": "error"}
    assert "regex grammar does not compile" in harness.log.error_messages["bad"]


def test_without_a_model_tokenizer_a_constrained_request_fails_and_others_run(backend: tokenizers.Tokenizer) -> None:
    harness = Harness()  # the fakes' config names no model
    add(harness, "c", 5)
    add(harness, "u", 5, None, max_tokens=3)
    harness.run()
    assert harness.log.finish_reasons == {"c": "error", "u": "length"}
    assert "knows no model tokenizer" in harness.log.error_messages["c"]


def test_an_unconstrained_step_carries_the_shared_empty_masks_and_builds_no_table(
        tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> None:
    harness = make_harness(tokenizer_dir, backend)
    add(harness, "u", 5, None, max_tokens=3)
    plan = harness.engine.schedule()
    assert plan is not None and plan.grammar is NO_MASKS
    assert not harness.engine.constraints.is_built


def test_a_request_keeps_at_most_30_attributes_so_its_instances_share_dict_keys() -> None:
    from scheduler_proc.request import Request

    request = Request("r", np.array([1, 2], dtype=np.int32), SamplingParams(), seed=0)
    assert len(vars(request)) <= 30, sorted(vars(request))  # CPython 3.11's shared-keys limit
