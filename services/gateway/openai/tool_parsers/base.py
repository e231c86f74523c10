"""What every tool-call format shares: parsing a whole output, streaming it, forcing a call.

A format (``ToolParser`` subclass) says where its calls start in the text (``find_calls``), how
the text after that point splits into call objects (``call_objects``), which keys carry the name
and the arguments, and how to write a grammar that makes the model emit calls in it
(``call_tag``, ``calls_format``). Parsing, streaming and the grammar are built from those here, once.

Arguments are reported as ``json.dumps`` of the parsed object (``", "`` and ``": "`` separators,
non-ASCII kept), both whole and streamed: streamed pieces are prefixes of that text, so they
concatenate to exactly the non-streamed ``arguments``.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

from pdserve.services.gateway.openai.structured_outputs import Constraint, st_json, st_tag, structural_tag

# partial JSON: containers may be open; an unfinished string, number or literal is left out
_PARTIAL = Allow.OBJ | Allow.ARR


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: the function ``name`` and its ``arguments`` as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """An output split into the text before the calls (None if empty) and the calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the request offers: its name and JSON Schema of parameters."""

    name: str
    parameters: dict[str, Any] | bool


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (the part of a
    marker a stream must hold back until it knows)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolParser(ABC):
    """One model family's tool-call format.

    Attributes:
        name: the ``--tool-call-parser`` value.
        arguments_keys: keys that may hold a call's arguments, in order of preference.
        skip_special_tokens: whether the output may be detokenized without special tokens (False
            where the call marker is a special token of the family's tokenizer).
    """

    name: ClassVar[str]
    arguments_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    skip_special_tokens: ClassVar[bool] = True
    separator: ClassVar[str] = "\n"  # between parallel calls

    @abstractmethod
    def find_calls(self, text: str) -> tuple[int, int] | None:
        """``(content_end, calls_start)`` when ``text`` has started its calls (the content is
        ``text[:content_end]``, the calls are in ``text[calls_start:]``), else None."""

    @abstractmethod
    def undecided_tail(self, text: str) -> int:
        """How many characters at the end of ``text`` (which has no calls yet) might still become
        the start of a call, so a stream must hold them back."""

    @abstractmethod
    def call_objects(self, calls: str, partial: bool) -> list[Any]:
        """The call objects in ``calls``. With ``partial``, the text may end mid-call: the last
        object is as much as has arrived (and no error is raised); else malformed text raises
        ValueError."""

    @abstractmethod
    def call_tag(self, tool: Tool) -> dict[str, Any]:
        """A structural-tag element for one call of ``tool`` in this format (its arguments held
        to the tool's schema)."""

    def calls_format(self, tags: list[dict[str, Any]], at_least_one: bool, parallel: bool) -> dict[str, Any]:
        """A structural-tag element for the calls section: one or more (``parallel``) of ``tags``,
        ``separator`` between them (a lone tag as it is)."""
        if len(tags) == 1 and not parallel:
            return tags[0]
        return self.tags_with_separator(tags, at_least_one, parallel)

    def tags_with_separator(self, tags: list[dict[str, Any]], at_least_one: bool, parallel: bool) -> dict:
        return {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": self.separator,
            "at_least_one": at_least_one,
            "stop_after_first": not parallel,
        }

    # ---- built from the above ----------------------------------------------------------------
    def parse(self, text: str) -> ParsedOutput:
        """Split a whole output into the text before its calls (None when only whitespace) and the
        calls. Malformed calls make the whole text content (never an error)."""
        found = self.find_calls(text)
        if found is None:
            return ParsedOutput(text or None, [])
        try:
            calls = [self.to_call(obj) for obj in self.call_objects(text[found[1] :], partial=False)]
        except ValueError:
            return ParsedOutput(text or None, [])
        if not calls:
            return ParsedOutput(text or None, [])
        content = text[: found[0]]
        return ParsedOutput(content if content.strip() else None, calls)

    def to_call(self, obj: Any) -> ToolCall:
        """A ``ToolCall`` from one complete call object; ValueError if it is not one."""
        name, arguments = self.fields(obj)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool call needs a name, got {obj!r:.200}")
        return ToolCall(name, json.dumps({} if arguments is None else arguments, ensure_ascii=False))

    def fields(self, obj: Any) -> tuple[Any, Any]:
        """``(name, arguments)`` of a (possibly partial) call object; None where absent."""
        if not isinstance(obj, dict):
            return None, None
        arguments = next((obj[k] for k in self.arguments_keys if k in obj), None)
        return obj.get("name"), arguments

    def partial_objects(self, text: str) -> list[Any]:
        """``call_objects`` helper: the JSON value(s) in an unfinished ``text`` (never raises)."""
        if not text.strip():
            return []
        try:
            return [partial_loads(text, _PARTIAL)]
        except Exception:  # partial_json_parser raises several types on text it cannot read yet
            return []

    def constraint(self, tools: list[Tool], forced: str | None, parallel: bool) -> Constraint:
        """The grammar of a response that is only calls: to ``forced`` (one call), or to any of
        ``tools`` (at least one; more than one only with ``parallel``)."""
        if forced is not None:
            tool = next(t for t in tools if t.name == forced)
            return structural_tag(self.calls_format([self.call_tag(tool)], True, False))
        return structural_tag(self.calls_format([self.call_tag(t) for t in tools], True, parallel))

    def object_tag(self, tool: Tool, begin: str, end: str) -> dict[str, Any]:
        """``call_tag`` helper: ``begin`` + ``{"name": "<tool>", "<key>": <arguments>}`` + ``end``,
        with the arguments under this format's first ``arguments_keys``."""
        head = f'{begin}{{"name": {json.dumps(tool.name)}, "{self.arguments_keys[0]}": '
        return st_tag(head, st_json(tool.parameters), "}" + end)
