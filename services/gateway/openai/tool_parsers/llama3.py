"""Llama 3.x JSON tool calls: the whole output is ``{"name": ..., "parameters": {...}}`` (calls
separated by ``; ``), optionally after the ``<|python_tag|>`` token (Llama 3.1/3.2/3.3)."""

from __future__ import annotations

import json
from typing import Any

from pdserve.services.gateway.openai.tool_parsers.base import Tool, ToolParser

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3Parser(ToolParser):
    name = "llama3"
    arguments_keys = ("parameters", "arguments")
    skip_special_tokens = False  # <|python_tag|> is a special token
    separator = "; "

    def find_calls(self, text: str) -> tuple[int, int] | None:
        body = text.lstrip()
        start = len(text) - len(body)
        if body.startswith(PYTHON_TAG):
            return start, start + len(PYTHON_TAG)
        return (start, start) if body.startswith("{") else None

    def undecided_tail(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if PYTHON_TAG.startswith(body) else 0

    def call_objects(self, calls: str, partial: bool) -> list[Any]:
        """Objects separated by ``;`` (and whitespace); each is decoded where it starts."""
        objects, at = [], 0
        while True:
            at = _skip(calls, at)
            if at == len(calls):
                return objects
            try:
                obj, at = _DECODER.raw_decode(calls, at)
            except ValueError:
                if partial:
                    return objects + self.partial_objects(calls[at:])
                raise
            objects.append(obj)

    def call_tag(self, tool: Tool) -> dict[str, Any]:
        return self.object_tag(tool, "", "")


def _skip(text: str, at: int) -> int:
    """The index of the next call after ``at``: past whitespace and ``;`` separators."""
    while at < len(text) and (text[at].isspace() or text[at] == ";"):
        at += 1
    return at
