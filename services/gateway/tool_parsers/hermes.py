"""Hermes / Qwen tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one
block per call (Qwen2.5, Qwen3, Hermes 2/3 and the many models trained on that format)."""

from __future__ import annotations

import json
from typing import Any

from pdserve.services.gateway.tool_parsers.base import Tool, ToolParser, partial_marker_len

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def find_calls(self, text: str) -> tuple[int, int] | None:
        at = text.find(START)
        return None if at < 0 else (at, at)

    def undecided_tail(self, text: str) -> int:
        return partial_marker_len(text, START)

    def call_objects(self, calls: str, partial: bool) -> list[Any]:
        objects = []
        for block in calls.split(START)[1:]:
            body = block.partition(END)[0]  # an unclosed last block counts if its JSON is whole
            objects += self.partial_objects(body) if partial else [json.loads(body)]
        return objects

    def call_tag(self, tool: Tool) -> dict[str, Any]:
        return self.object_tag(tool, START + "\n", "\n" + END)
