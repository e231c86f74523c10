"""Constrained-decoding request forms and the grammar each one becomes.

A request may hold its output to one constraint, given as OpenAI's ``response_format``
(``json_object`` / ``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``, ``structural_tag``), SGLang's ``sampling_params`` (``json_schema``,
``regex``, ``ebnf``, ``structural_tag``; ``native_protocol``), or a tool choice that forces a call
(``tool_parsers``). Each becomes a ``Constraint``: a grammar kind and text the schedulers compile
(``pdserve.constrained``); whether it compiles is the schedulers' answer (a 400 naming the problem).

Structural tags are xgrammar's JSON format for composed grammars (free text, tags, JSON Schemas,
regexes, sequences and alternatives); the gateway writes them as plain JSON (``st_*`` helpers), so
it needs no grammar library itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from pdserve.sampling.bounds import MAX_CHOICE_CHARS, MAX_CHOICES, MAX_GRAMMAR_CHARS
from pdserve.services.gateway.openai.protocol_fields import RequestModel, param_error

# Longest run of whitespace a generated JSON part may hold: small models loop on blank lines.
JSON_MAX_WHITESPACE = 1

GrammarText = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)


@dataclass(frozen=True, slots=True)
class Constraint:
    """A grammar for the schedulers: ``kind`` is a ``SamplingParams`` field name
    (``json_schema``, ``regex``, ``ebnf``, ``structural_tag``) and ``text`` its value."""

    kind: str
    text: str

    def as_format(self) -> dict[str, Any]:
        """This constraint as one element of a structural tag (to compose it with others)."""
        if self.kind == "json_schema":
            return st_json(json.loads(self.text))
        if self.kind == "regex":
            return {"type": "regex", "pattern": self.text}
        if self.kind == "ebnf":
            return {"type": "grammar", "grammar": self.text}
        return json.loads(self.text)["format"]


def structural_tag(fmt: dict[str, Any]) -> Constraint:
    """A structural-tag constraint whose whole output is ``fmt``."""
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


def st_json(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": JSON_MAX_WHITESPACE}


def st_const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def st_tag(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def st_sequence(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def json_schema_constraint(schema: Any, param: str) -> Constraint:
    """A JSON Schema given as an object (or JSON text); a 400 naming ``param`` if it is not JSON or
    is too big (whether it is a valid schema is the schedulers' to say)."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise param_error(param, f"the schema has {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")
    try:
        json.loads(text)
    except ValueError as e:
        raise param_error(param, f"the schema is not valid JSON: {e}") from None
    return Constraint("json_schema", text)


class JsonSchemaSpec(RequestModel):
    """OpenAI's ``response_format.json_schema``: ``{"name", "description", "schema", "strict"}``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    schema_: dict[str, Any] | bool = Field(True, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise param_error(
                "response_format.json_schema", "response_format type 'json_schema' needs 'json_schema'"
            )
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "json_object":
            return Constraint("json_schema", '{"type": "object"}')
        if self.type == "json_schema":
            return json_schema_constraint(self.json_schema.schema_, "response_format.json_schema.schema")
        return None


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, as an object or JSON text),
    ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (EBNF),
    ``json_object`` (true: any JSON object) and ``structural_tag`` (xgrammar's JSON format)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = GrammarText
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = GrammarText
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
            if getattr(self, "json_" if name == "json" else name) not in (None, False)
        ]
        if len(given) != 1:
            raise param_error(
                "structured_outputs",
                "give exactly one of json, regex, choice, grammar, json_object, structural_tag "
                f"(got {given})",
            )
        if self.choice is not None and any(not c or len(c) > MAX_CHOICE_CHARS for c in self.choice):
            raise param_error(
                "structured_outputs.choice", f"each choice must have 1 to {MAX_CHOICE_CHARS} characters"
            )
        return self

    def constraint(self) -> Constraint:
        if self.json_ is not None:
            return json_schema_constraint(self.json_, "structured_outputs.json")
        if self.regex is not None:
            return Constraint("regex", self.regex)
        if self.grammar is not None:
            return Constraint("ebnf", self.grammar)
        if self.choice is not None:
            return structural_tag({"type": "or", "elements": [st_const(c) for c in self.choice]})
        if self.json_object:
            return Constraint("json_schema", '{"type": "object"}')
        tag = self.structural_tag
        param = "structured_outputs.structural_tag"
        try:
            tag = json.loads(tag) if isinstance(tag, str) else tag
        except ValueError as e:
            raise param_error(param, f"not valid JSON: {e}") from None
        if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or "format" not in tag:
            raise param_error(param, 'expected {"type": "structural_tag", "format": {...}}')
        text = json.dumps(tag)
        if len(text) > MAX_GRAMMAR_CHARS:
            raise param_error(param, f"at most {MAX_GRAMMAR_CHARS} characters")
        return Constraint("structural_tag", text)


def request_constraint(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputs | None
) -> Constraint | None:
    """The one constraint of an OpenAI request; raises a 400 when it names two."""
    from_format = response_format.constraint() if response_format is not None else None
    from_outputs = structured_outputs.constraint() if structured_outputs is not None else None
    if from_format is not None and from_outputs is not None:
        raise param_error("structured_outputs", "give either response_format or structured_outputs, not both")
    return from_format or from_outputs
