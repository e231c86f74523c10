"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON list ``[{"name": ..., "arguments": {...}}, ...]``
(Mistral 7B v0.3, Mixtral 8x22B, Mistral Small/Nemo). ``[TOOL_CALLS]`` is a special token of
their tokenizers, so such outputs are detokenized with special tokens kept."""

from __future__ import annotations

import json
from typing import Any

from pdserve.services.gateway.openai.structured_outputs import st_const, st_sequence
from pdserve.services.gateway.openai.tool_parsers.base import Tool, ToolParser, partial_marker_len

TOOL_CALLS = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False
    separator = ", "

    def find_calls(self, text: str) -> tuple[int, int] | None:
        at = text.find(TOOL_CALLS)
        return None if at < 0 else (at, at + len(TOOL_CALLS))

    def undecided_tail(self, text: str) -> int:
        return partial_marker_len(text, TOOL_CALLS)

    def call_objects(self, calls: str, partial: bool) -> list[Any]:
        value = self.partial_objects(calls) if partial else [json.loads(calls)]
        if not value:
            return []
        return value[0] if isinstance(value[0], list) else value  # a lone object is one call

    def call_tag(self, tool: Tool) -> dict[str, Any]:
        return self.object_tag(tool, "", "")

    def calls_format(self, tags: list[dict[str, Any]], at_least_one: bool, parallel: bool) -> dict[str, Any]:
        calls = self.tags_with_separator(tags, at_least_one, parallel)
        return st_sequence(st_const(TOOL_CALLS + "["), calls, st_const("]"))
