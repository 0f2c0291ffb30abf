"""Structured output fields of a request -> one GrammarSpec, or a 400 naming the field and the problem.

Sources: OpenAI's `response_format` (text, json_object, json_schema), vLLM's
`structured_outputs` (json, regex, choice, grammar, json_object) and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. A request may use one of them; whether the
grammar compiles is checked next by frontend/grammar_check.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

from frontend.errors import bad_request, from_validation_error
from frontend.protocol import ResponseFormat, SamplingFields, StructuredOutputs
from proto.errors import ValidationError
from proto.grammar import GrammarSpec

_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
_GBNF_RULE = re.compile(r"^\s*[A-Za-z][\w-]*\s*::=", re.MULTILINE)


def request_grammar(request: SamplingFields) -> tuple[GrammarSpec, str] | None:
    """The request's output constraint and the field it came from, or None for free text."""
    found = [(spec, param) for spec, param in (
        _from_response_format(request.response_format),
        _from_structured_outputs(request.structured_outputs),
        _from_guided(request),
    ) if spec is not None]
    if len(found) > 1:
        raise bad_request(f"send one output constraint, got {found[0][1]} and {found[1][1]}",
                          found[1][1])
    return found[0] if found else None


def _from_response_format(response_format: ResponseFormat | None) -> tuple[GrammarSpec | None, str]:
    param = "response_format"
    if response_format is None or response_format.type == "text":
        return None, param
    if response_format.type == "json_object":
        return _spec("json_object", "", param), param
    body = response_format.json_schema
    if body is None:
        raise bad_request('response_format.json_schema is required with type "json_schema": send '
                          '{"name": ..., "schema": {...}}', "response_format.json_schema")
    name = body.get("name")
    if name is not None and not (isinstance(name, str) and _SCHEMA_NAME.match(name)):
        raise bad_request("response_format.json_schema.name must be 1 to 64 letters, digits, _ or -",
                          "response_format.json_schema.name")
    if not isinstance(body.get("strict", False), bool):
        raise bad_request("response_format.json_schema.strict must be a boolean",
                          "response_format.json_schema.strict")
    if "schema" not in body:
        raise bad_request("response_format.json_schema.schema is required",
                          "response_format.json_schema.schema")
    schema_param = "response_format.json_schema.schema"
    return _schema_spec(body["schema"], schema_param), schema_param


def _from_structured_outputs(options: StructuredOutputs | None) -> tuple[GrammarSpec | None, str]:
    if options is None:
        return None, "structured_outputs"
    if options.structural_tag is not None:
        raise bad_request("structured_outputs.structural_tag is not supported: use json, regex, "
                          "choice or grammar", "structured_outputs.structural_tag")
    given = {"json": options.json_, "regex": options.regex, "choice": options.choice,
             "grammar": options.grammar, "json_object": options.json_object or None}
    named = [key for key, value in given.items() if value is not None]
    if len(named) != 1:
        raise bad_request("structured_outputs needs exactly one of json, regex, choice, grammar, "
                          f"json_object, got {', '.join(named) or 'none'}", "structured_outputs")
    return _constraint(named[0], given[named[0]], f"structured_outputs.{named[0]}")


def _from_guided(request: SamplingFields) -> tuple[GrammarSpec | None, str]:
    given = {"json": request.guided_json, "regex": request.guided_regex,
             "choice": request.guided_choice, "grammar": request.guided_grammar}
    named = [key for key, value in given.items() if value is not None]
    if not named:
        return None, "guided_json"
    if len(named) > 1:
        raise bad_request(f"send one of guided_json, guided_regex, guided_choice, guided_grammar, got "
                          f"{', '.join('guided_' + key for key in named)}", f"guided_{named[1]}")
    return _constraint(named[0], given[named[0]], f"guided_{named[0]}")


def _constraint(key: str, value: Any, param: str) -> tuple[GrammarSpec, str]:
    if key == "json":
        return _schema_spec(value, param), param
    if key == "json_object":
        return _spec("json_object", "", param), param
    if key == "choice":
        if not value:
            raise bad_request(f"{param} must list at least one string", param)
        return _spec("choice", json.dumps(value, separators=(",", ":"), ensure_ascii=False), param), param
    if key == "grammar":
        return _spec("grammar", _lark(value, param), param), param
    return _spec("regex", value, param), param


def _schema_spec(schema: Any, param: str) -> GrammarSpec:
    """A schema object, `true`/`false`, or the JSON text of one (vLLM accepts both)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object or a boolean), got "
                          f"{type(schema).__name__}", param)
    try:
        return GrammarSpec.json_schema(schema)
    except ValidationError as exc:
        raise from_validation_error(ValidationError(exc.message, param)) from None


def _lark(grammar: str, param: str) -> str:
    """Lark as llguidance reads it; a GBNF grammar (rules written `name ::= ...`) is converted."""
    if is_lark_syntax(grammar) or not _GBNF_RULE.search(grammar):
        return grammar
    try:
        return gbnf_to_lark(grammar)
    except Exception as exc:  # the converter's own error, and also bare Exception / IndexError on odd input
        raise bad_request(f"{param} is not a valid GBNF grammar: {exc}", param) from None


def _spec(kind: str, source: str, param: str) -> GrammarSpec:
    try:
        return GrammarSpec(kind, source)
    except ValidationError as exc:
        raise from_validation_error(ValidationError(exc.message, param)) from None
