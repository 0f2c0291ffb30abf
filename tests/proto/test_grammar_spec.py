"""GrammarSpec: the constraint that travels with a request, and its engine grammar text."""

from __future__ import annotations

import json

import pytest

from proto.errors import ValidationError
from proto.grammar import MAX_GRAMMAR_SOURCE_CHARS, GrammarSpec, engine_grammar


def test_one_schema_is_one_spec_and_its_key_order_is_kept() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    a, b = GrammarSpec.json_schema(schema), GrammarSpec.json_schema(json.loads(json.dumps(schema)))
    assert a == b and hash(a) == hash(b)
    assert a.source.index('"b"') < a.source.index('"a"')  # the output follows `properties`' order


@pytest.mark.parametrize("kind, source, param", [
    ("yaml", "a: 1", "grammar.kind"),
    ("regex", "", "grammar.source"),
    ("choice", "[]", "grammar.source"),
    ("choice", '["a", 1]', "grammar.source"),
    ("choice", "not json", "grammar.source"),
    ("grammar", "x" * (MAX_GRAMMAR_SOURCE_CHARS + 1), "grammar.source"),
])
def test_malformed_spec_is_refused_naming_the_field(kind: str, source: str, param: str) -> None:
    with pytest.raises(ValidationError) as info:
        GrammarSpec(kind, source)
    assert info.value.param == param


def test_json_schema_grammar_has_fixed_separators_unless_the_schema_says_otherwise() -> None:
    grammar = json.loads(engine_grammar(GrammarSpec.json_schema({"type": "integer"})))
    assert grammar["grammars"][0]["json_schema"]["x-guidance"] == {
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    own = {"type": "integer", "x-guidance": {"whitespace_flexible": True}}
    grammar = json.loads(engine_grammar(GrammarSpec.json_schema(own)))
    assert grammar["grammars"][0]["json_schema"]["x-guidance"]["whitespace_flexible"] is True
    anything = json.loads(engine_grammar(GrammarSpec.json_schema(True)))  # the schema `true`, as {}
    assert anything["grammars"][0]["json_schema"] == {"x-guidance": {
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


def test_json_object_is_any_object() -> None:
    grammar = json.loads(engine_grammar(GrammarSpec("json_object", "")))
    assert grammar["grammars"][0]["json_schema"]["type"] == "object"


@pytest.mark.parametrize("regex, lark", [
    ("a/b", r"start: /a\/b/"),
    (r"a\/b", r"start: /a\/b/"),
    (r"a\\/b", r"start: /a\\\/b/"),
    (r"\d+", r"start: /\d+/"),
])
def test_regex_slashes_are_escaped_once_inside_lark_slashes(regex: str, lark: str) -> None:
    grammar = json.loads(engine_grammar(GrammarSpec("regex", regex)))
    assert grammar["grammars"][0]["lark_grammar"] == lark


def test_choices_become_quoted_lark_alternatives() -> None:
    grammar = json.loads(engine_grammar(GrammarSpec.choice(['say "hi"', "ünï"])))
    assert grammar["grammars"][0]["lark_grammar"] == 'start: "say \\"hi\\"" | "ünï"'


def test_object_schemas_are_closed_where_they_say_nothing_of_other_keys() -> None:
    schema = {"type": "object", "properties": {
        "loc": {"type": "object", "properties": {"x": {"type": "number"}}},
        "tags": {"type": "array", "items": {"properties": {"t": {}}}},
        "open": {"properties": {"y": {}}, "additionalProperties": {"type": "integer"}},
        "either": {"anyOf": [{"properties": {"a": {}}}, {"type": "null"}]},
        "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}}}
    closed = json.loads(engine_grammar(GrammarSpec.json_schema(schema)))["grammars"][0]["json_schema"]
    properties = closed["properties"]
    assert closed["additionalProperties"] is False
    assert properties["loc"]["additionalProperties"] is False
    assert properties["tags"]["items"]["additionalProperties"] is False
    assert properties["open"]["additionalProperties"] == {"type": "integer"}
    assert properties["either"]["anyOf"][0]["additionalProperties"] is False
    assert all("additionalProperties" not in part for part in properties["both"]["allOf"])  # an intersection
    assert "additionalProperties" not in json.loads(GrammarSpec.json_schema(schema).source)  # the spec keeps the client's

