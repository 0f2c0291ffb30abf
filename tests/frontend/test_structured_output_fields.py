"""response_format, structured_outputs and guided_* -> one GrammarSpec, or a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from frontend.errors import APIError
from frontend.grammar_check import GrammarChecker
from frontend.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from frontend.structured_output import request_grammar
from frontend.tokenizer import Tokenizer
from proto.grammar import GrammarSpec
from tiny_model import build_tiny_tokenizer

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _grammar(**fields: Any) -> tuple[GrammarSpec, str] | None:
    body = {"prompt": "x", **fields}
    return request_grammar(parse_body(json.dumps(body).encode(), CompletionRequest))


def _refused(**fields: Any) -> APIError:
    with pytest.raises(APIError) as info:
        _grammar(**fields)
    assert info.value.status == 400
    return info.value


@pytest.fixture(scope="module")
def checker(tmp_path_factory: pytest.TempPathFactory) -> GrammarChecker:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(out)
    tokenizer = Tokenizer.from_dir(out)
    return GrammarChecker.for_tokenizer(tokenizer, 512, (tokenizer.eos_token_id,))


def test_text_and_absent_formats_are_free_text() -> None:
    assert _grammar() is None
    assert _grammar(response_format={"type": "text"}) is None


def test_json_schema_response_format_on_chat_names_the_schema_field() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "City", "schema": SCHEMA, "strict": True}}}
    spec, param = request_grammar(parse_body(json.dumps(body).encode(), ChatCompletionRequest))
    assert spec == GrammarSpec.json_schema(SCHEMA)
    assert param == "response_format.json_schema.schema"


def test_json_object_from_each_spelling() -> None:
    assert _grammar(response_format={"type": "json_object"})[0] == GrammarSpec("json_object", "")
    assert _grammar(structured_outputs={"json_object": True})[0] == GrammarSpec("json_object", "")


@pytest.mark.parametrize("fields, spec, param", [
    ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec.json_schema(SCHEMA), "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, GrammarSpec.json_schema(SCHEMA),
     "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, GrammarSpec("regex", "[0-9]+"), "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, GrammarSpec.choice(["yes", "no"]),
     "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, GrammarSpec("grammar", 'start: "a"+'),
     "structured_outputs.grammar"),
    ({"guided_json": SCHEMA}, GrammarSpec.json_schema(SCHEMA), "guided_json"),
    ({"guided_regex": "a|b"}, GrammarSpec("regex", "a|b"), "guided_regex"),
    ({"guided_choice": ["x"]}, GrammarSpec.choice(["x"]), "guided_choice"),
])
def test_vllm_fields_become_specs(fields: dict[str, Any], spec: GrammarSpec, param: str) -> None:
    assert _grammar(**fields) == (spec, param)


def test_gbnf_grammar_is_converted_to_lark() -> None:
    spec, _ = _grammar(structured_outputs={"grammar": 'root ::= "yes" | "no"'})
    assert spec.kind == "grammar" and 'start: "yes"' in spec.source


@pytest.mark.parametrize("fields, param, says", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema', got \"xml\""),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", "letters, digits"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema", "must be a JSON schema"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "got none"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"grammar": 'root ::= ("a"'}}, "structured_outputs.grammar", "not a valid GBNF"),
    ({"structured_outputs": {"grammar": "root ::= 3f"}}, "structured_outputs.grammar", "not a valid GBNF"),
    ({"guided_grammar": 'root ::= h"`h_;JWF[7ap.\\'}, "guided_grammar", "not a valid GBNF"),
    ({"structured_outputs": {"regx": "a"}}, "structured_outputs.regx", "Extra inputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "send one of"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one output constraint"),
])
def test_bad_constraint_is_a_400_naming_the_field(fields: dict[str, Any], param: str, says: str) -> None:
    error = _refused(**fields)
    assert error.param == param and says in error.message


@pytest.mark.parametrize("spec, code, says", [
    (GrammarSpec.json_schema({"type": "objekt"}), "invalid_grammar", "Invalid type"),
    (GrammarSpec.json_schema({"not": {"type": "string"}}), "unsupported_schema_feature", '["not"]'),
    (GrammarSpec.json_schema({"type": "string", "format": "colour"}), "invalid_grammar", "Unknown format"),
    (GrammarSpec("regex", "a("), "invalid_grammar", "unclosed group"),
    (GrammarSpec("grammar", "start: nothing"), "invalid_grammar", "unknown name"),
])
def test_a_grammar_that_does_not_compile_is_a_400_with_the_engine_reason(
        checker: GrammarChecker, spec: GrammarSpec, code: str, says: str) -> None:
    with pytest.raises(APIError) as info:
        checker.check(spec, "the.field")
    assert info.value.param == "the.field" and info.value.code == code
    assert says in info.value.message and "\n" not in info.value.message


@pytest.mark.parametrize("spec", [GrammarSpec.json_schema(SCHEMA), GrammarSpec("json_object", ""),
                                  GrammarSpec("regex", "[a-z]+@[a-z]+"), GrammarSpec.choice(['a "b"']),
                                  GrammarSpec.json_schema({"$ref": "#/$defs/A",
                                                           "$defs": {"A": {"type": "integer"}}})])
def test_supported_grammars_pass_the_check(checker: GrammarChecker, spec: GrammarSpec) -> None:
    checker.check(spec, "p")
    checker.check(spec, "p")  # cached
