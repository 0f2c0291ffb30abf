"""The constraint on one request's output (structured output), and its text in the engine's grammar format.

The frontend turns `response_format`, `structured_outputs`, `guided_*` and forced tool choices
into a GrammarSpec and checks that it compiles; the scheduler compiles it again for its
matchers. `engine_grammar` is the one definition of what a spec means, shared by both, written
as llguidance's top-level grammar JSON with the standard library only (no engine in proto).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from proto.errors import ValidationError

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_SOURCE_CHARS = 200_000  # a schema or grammar larger than this is refused, not compiled
MAX_CHOICES = 1024

# Keys and items separated as json.dumps does by default (", " and ": "), and no other
# whitespace: a small model left free to emit whitespace can fill max_tokens with newlines
# inside a valid document. A schema's own "x-guidance" options win.
JSON_SCHEMA_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. `source` by kind:

    - json_schema: the schema as JSON text, compact, keys in the client's order (the output's
      properties follow the order of `properties`, so two orders are two grammars);
    - json_object: "" (any JSON object);
    - regex: the pattern (Rust regex syntax, matched against the whole output);
    - choice: a JSON array of the allowed strings, e.g. '["yes","no"]';
    - grammar: a Lark grammar in llguidance's dialect (the frontend converts GBNF first).
    """

    kind: str
    source: str

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValidationError naming the field, the limit and the value."""
        if self.kind not in GRAMMAR_KINDS:
            raise ValidationError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, "
                                  f"got {self.kind!r}", "grammar.kind")
        if not isinstance(self.source, str):
            raise ValidationError(f"grammar source must be a string, got {type(self.source).__name__}",
                                  "grammar.source")
        if len(self.source) > MAX_GRAMMAR_SOURCE_CHARS:
            raise ValidationError(f"a grammar may have at most {MAX_GRAMMAR_SOURCE_CHARS} characters, "
                                  f"got {len(self.source)}", "grammar.source")
        if self.kind == "choice":
            _check_choices(self.source)
        elif self.kind in ("json_schema", "regex", "grammar") and not self.source:
            raise ValidationError(f"a {self.kind} grammar must not be empty", "grammar.source")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "GrammarSpec":
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def choice(cls, choices: list[str]) -> "GrammarSpec":
        return cls("choice", json.dumps(choices, separators=(",", ":"), ensure_ascii=False))


def _check_choices(source: str) -> None:
    try:
        choices = json.loads(source)
    except (ValueError, RecursionError):  # RecursionError: arrays nested past the interpreter's depth
        choices = None
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise ValidationError("choice grammar source must be a JSON array of strings", "grammar.source")
    if not 1 <= len(choices) <= MAX_CHOICES:
        raise ValidationError(f"choice needs between 1 and {MAX_CHOICES} strings, got {len(choices)}",
                              "grammar.source")


def engine_grammar(spec: GrammarSpec) -> str:
    """llguidance's top-level grammar JSON for `spec` (what LLMatcher compiles)."""
    if spec.kind in ("json_schema", "json_object"):
        schema = json.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}
        if schema is True:  # any JSON value, as {} is: which takes the separators below
            schema = {}
        if isinstance(schema, dict):
            close_objects(schema)
            schema = {**schema, "x-guidance": {**JSON_SCHEMA_OPTIONS, **schema.get("x-guidance", {})}}
        return json.dumps({"grammars": [{"json_schema": schema}]}, ensure_ascii=False)
    if spec.kind == "regex":
        lark = "start: /" + _escape_slashes(spec.source) + "/"
    elif spec.kind == "choice":
        literals = [json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec.source)]
        lark = "start: " + " | ".join(literals)
    else:
        lark = spec.source
    return json.dumps({"grammars": [{"lark_grammar": lark}]}, ensure_ascii=False)


# A node with any of these says what other keys may do, or is combined with another schema: closing
# it (or a schema it is combined with) could forbid what the other part allows.
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
              "$ref", "dependentSchemas", "if")
_SUBSCHEMA_KEYS = ("items", "additionalItems", "contains", "additionalProperties", "unevaluatedItems")
_SUBSCHEMA_MAP_KEYS = ("properties", "patternProperties")
_DEFINITION_KEYS = ("$defs", "definitions")


def close_objects(schema: dict) -> None:
    """In place: every plain object schema that lists `properties` (and requires no other key)
    gets "additionalProperties": false, so the output holds only the properties the schema names
    (JSON Schema would allow any others, and a small model fills them with invented keys), as
    vLLM's default engine (xgrammar, strict mode) reads schemas. A schema keeps other keys open by
    saying so ("additionalProperties": true or a schema, patternProperties, unevaluatedProperties).
    Whatever is combined with another schema is left as written, with all below it: allOf and
    dependentSchemas members, anyOf / oneOf members beside the node's own properties, a node with
    $ref beside other keywords and the definitions such $refs name (closing one part of an
    intersection would forbid the other part's keys); not / if / then / else are not entered."""
    combined_refs = _combined_refs(schema)
    stack: list[tuple[dict, bool]] = [(schema, True)]
    while stack:
        node, closable = stack.pop()
        properties = node.get("properties")
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if (closable and isinstance(properties, dict) and not any(key in node for key in _OPEN_KEYS)
                and all(key in properties for key in required)):
            node["additionalProperties"] = False
        stack.extend((child, closable and child_closable) for child, child_closable in _children(node)
                     if isinstance(child, dict))
        for key in _DEFINITION_KEYS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"#/{key}/{name}" not in combined_refs)
                             for name, sub in node[key].items() if isinstance(sub, dict))


def _children(node: dict) -> list[tuple[object, bool]]:
    """A node's subschemas (definitions aside) and whether each may be closed."""
    beside_properties = isinstance(node.get("properties"), dict)
    children: list[tuple[object, bool]] = [(node.get(key), True) for key in _SUBSCHEMA_KEYS]
    children += [(sub, True) for key in _SUBSCHEMA_MAP_KEYS if isinstance(node.get(key), dict)
                 for sub in node[key].values()]
    if isinstance(node.get("items"), list):
        children += [(sub, True) for sub in node["items"]]
    if isinstance(node.get("prefixItems"), list):
        children += [(sub, True) for sub in node["prefixItems"]]
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            children += [(sub, not beside_properties) for sub in node[key]]
    if isinstance(node.get("allOf"), list):
        children += [(sub, False) for sub in node["allOf"]]
    if isinstance(node.get("dependentSchemas"), dict):
        children += [(sub, False) for sub in node["dependentSchemas"].values()]
    return children


def _combined_refs(schema: dict) -> set[str]:
    """The $refs whose targets are combined with another schema: those in a part left open by
    close_objects' rules (e.g. an allOf member) and those beside other keywords."""
    refs: set[str] = set()
    stack: list[tuple[object, bool]] = [(schema, True)]
    while stack:
        node, closable = stack.pop()
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and (not closable or any(key not in ("$ref", "description", "title")
                                                          for key in node)):
            refs.add(ref)
        stack.extend((child, closable and child_closable) for child, child_closable in _children(node))
        stack.extend((sub, True) for key in _DEFINITION_KEYS if isinstance(node.get(key), dict)
                     for sub in node[key].values())
    return refs


def _escape_slashes(regex: str) -> str:
    """`regex` inside Lark's /.../: every unescaped slash escaped, escapes kept as they are."""
    out, i = [], 0
    while i < len(regex):
        if regex[i] == "\\":
            out.append(regex[i:i + 2])
            i += 2
            continue
        out.append("\\/" if regex[i] == "/" else regex[i])
        i += 1
    return "".join(out)
