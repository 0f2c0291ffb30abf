"""Scheduler grammar state: compiled grammars cached, matchers advanced on accepted tokens, bitmask rows."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import numpy as np
import pytest
import tokenizers

from proto.grammar import GrammarSpec, engine_grammar
from scheduler_proc.grammar import GrammarError, GrammarTable, bitmask_words, fill_bitmask

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                           "role": {"enum": ["admin", "user"]},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "n", "role", "tags"], "additionalProperties": False}
DOCUMENT = '{"name": "fox", "n": 12, "role": "admin", "tags": ["a", "bc"]}'
MODEL_VOCAB = 520  # the tiny tokenizer has 512 tokens; the model's logits are wider


@pytest.fixture()
def table(tokenizer_dir: Path, backend: tokenizers.Tokenizer) -> GrammarTable:
    return GrammarTable.from_model_dir(tokenizer_dir, MODEL_VOCAB, [backend.token_to_id("<|im_end|>")])


def _allowed(row: np.ndarray, token_id: int) -> bool:
    return bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)


def _encode(backend: tokenizers.Tokenizer, text: str) -> list[int]:
    return backend.encode(text, add_special_tokens=False).ids


def test_every_token_of_a_valid_document_is_allowed_and_eos_only_at_its_end(
        table: GrammarTable, backend: tokenizers.Tokenizer) -> None:
    eos = backend.token_to_id("<|im_end|>")
    grammar = table.start(GrammarSpec.json_schema(SCHEMA))
    row = table.allocate_bitmask(1)[0]
    for token_id in _encode(backend, DOCUMENT):
        grammar.fill_row(row)
        assert _allowed(row, token_id) and not _allowed(row, eos)
        grammar.advance(token_id)
    grammar.fill_row(row)
    assert grammar.is_accepting and _allowed(row, eos)


def test_ids_beyond_the_tokenizer_are_never_allowed(table: GrammarTable) -> None:
    row = table.allocate_bitmask(1)[0]
    table.start(GrammarSpec("regex", ".*")).fill_row(row)
    assert row.shape == (bitmask_words(MODEL_VOCAB),)
    assert not any(_allowed(row, t) for t in range(512, MODEL_VOCAB))


def test_a_rejected_token_raises_naming_the_token_and_position(
        table: GrammarTable, backend: tokenizers.Tokenizer) -> None:
    grammar = table.start(GrammarSpec.choice(["yes", "no"]))
    with pytest.raises(GrammarError, match=r"token \d+ at output position 0"):
        grammar.advance(_encode(backend, "fox")[0])


def test_one_compiled_grammar_serves_independent_sequences(
        table: GrammarTable, backend: tokenizers.Tokenizer) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    first, second = table.start(spec), table.start(GrammarSpec.json_schema(dict(SCHEMA)))
    assert table.num_cached == 1
    first.replay(_encode(backend, DOCUMENT))
    assert first.is_accepting and not second.is_accepting
    second.advance(_encode(backend, "{")[0])


def test_replayed_matcher_masks_as_the_one_advanced_step_by_step(
        table: GrammarTable, backend: tokenizers.Tokenizer) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    prefix = _encode(backend, DOCUMENT)[:9]
    stepped = table.start(spec)
    for token_id in prefix:
        stepped.advance(token_id)
    resumed = table.resume(spec, prefix)
    rows = fill_bitmask([stepped, resumed], table.allocate_bitmask(4))
    assert rows.shape == (2, bitmask_words(MODEL_VOCAB))
    np.testing.assert_array_equal(rows[0], rows[1])
    assert resumed.num_consumed_tokens == len(prefix)


def test_each_row_gets_its_own_grammar(table: GrammarTable, backend: tokenizers.Tokenizer) -> None:
    yes_no = table.start(GrammarSpec.choice(["yes", "no"]))
    digits = table.start(GrammarSpec("regex", "[0-9]+"))
    rows = fill_bitmask([yes_no, digits], table.allocate_bitmask(2))
    assert _allowed(rows[0], _encode(backend, "y")[0]) and not _allowed(rows[1], _encode(backend, "y")[0])
    assert _allowed(rows[1], _encode(backend, "7")[0]) and not _allowed(rows[0], _encode(backend, "7")[0])


def test_finished_when_only_eos_can_follow(table: GrammarTable, backend: tokenizers.Tokenizer) -> None:
    grammar = table.start(GrammarSpec.choice(["yes"]))
    grammar.replay(_encode(backend, "yes"))
    assert grammar.is_accepting and grammar.is_finished


@pytest.mark.parametrize("spec", [GrammarSpec("regex", "a(b"), GrammarSpec("grammar", "start: foo"),
                                  GrammarSpec("json_schema", '{"type": "objekt"}')])
def test_a_grammar_that_does_not_compile_is_an_error_and_not_cached(
        table: GrammarTable, spec: GrammarSpec) -> None:
    with pytest.raises(GrammarError, match="does not compile"):
        table.start(spec)
    assert table.num_cached == 0


@pytest.mark.parametrize("regex", ["a/b", r"a\/b", r"a\\/b", r"x\ny"])
def test_regex_grammar_text_is_what_llguidance_itself_writes(regex: str) -> None:
    ours = json.loads(engine_grammar(GrammarSpec("regex", regex)))["grammars"][0]["lark_grammar"]
    theirs = json.loads(llguidance.LLMatcher.grammar_from_regex(regex))["grammars"][0]["lark_grammar"]
    assert ours == theirs


def test_eos_is_consumed_only_where_the_grammar_accepts(table: GrammarTable,
                                                         backend: tokenizers.Tokenizer) -> None:
    eos = backend.token_to_id("<|im_end|>")
    early = table.start(GrammarSpec("regex", "[0-9]+"))
    with pytest.raises(GrammarError):
        early.advance(eos)
    done = table.start(GrammarSpec("regex", "[0-9]+"))
    done.replay([*_encode(backend, "7"), eos])
    assert done.is_finished


@pytest.mark.parametrize("extra, accepted", [(None, False), (True, True)])
def test_an_object_takes_only_the_properties_it_names_unless_its_schema_opens_it(
        table: GrammarTable, backend: tokenizers.Tokenizer, extra: bool | None, accepted: bool) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    if extra is not None:
        schema["additionalProperties"] = extra
    grammar = table.start(GrammarSpec.json_schema(schema))
    tokens = _encode(backend, '{"city": "Paris", "country": "France"}')
    if accepted:
        grammar.replay(tokens)
        assert grammar.is_accepting
    else:
        with pytest.raises(GrammarError):
            grammar.replay(tokens)


BASE = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("schema, document", [
    ({"$defs": {"Base": BASE}, "allOf": [{"$ref": "#/$defs/Base"},
                                         {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     '{"a": 1, "b": 2}'),
    ({"$defs": {"Base": BASE}, "$ref": "#/$defs/Base", "properties": {"b": {"type": "integer"}},
      "required": ["a", "b"]}, '{"a": 1, "b": 2}'),
    ({"properties": {"kind": {"type": "string"}}, "required": ["kind"],
      "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                {"properties": {"y": {"type": "integer"}}, "required": ["y"]}]}, '{"kind": "k", "x": 1}'),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, '{"a": 1, "b": 2}'),
    ({"allOf": [{"properties": {"o": {"properties": {"x": {"type": "integer"}}}}},
                {"properties": {"o": {"properties": {"y": {"type": "integer"}}}}}]}, '{"o": {"x": 1, "y": 2}}'),
])
def test_schemas_combined_with_others_are_not_closed_against_each_other(
        table: GrammarTable, backend: tokenizers.Tokenizer, schema: dict, document: str) -> None:
    grammar = table.start(GrammarSpec.json_schema(schema))
    grammar.replay(_encode(backend, document))
    assert grammar.is_accepting


def test_a_definition_used_as_a_property_is_closed() -> None:
    schema = {"$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
              "type": "object", "properties": {"addr": {"$ref": "#/$defs/Addr"}}, "required": ["addr"]}
    closed = json.loads(engine_grammar(GrammarSpec.json_schema(schema)))["grammars"][0]["json_schema"]
    assert closed["$defs"]["Addr"]["additionalProperties"] is False and closed["additionalProperties"] is False
