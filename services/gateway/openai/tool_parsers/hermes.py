"""Hermes / Qwen tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one
block per call (Qwen2.5, Qwen3, Hermes 2/3 and the many models trained on that format)."""

from __future__ import annotations

import json
from typing import Any

from pdserve.services.gateway.openai.tool_parsers.base import Tool, ToolParser, partial_marker_len

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def find_calls(self, text: str) -> tuple[int, int] | None:
        at = text.find(START)
        return None if at < 0 else (at, at)

    def undecided_tail(self, text: str) -> int:
        return partial_marker_len(text, START)

    def call_objects(self, calls: str, partial: bool) -> list[Any]:
        """The blocks' call objects. An unclosed last block counts if its JSON is whole; if not (the
        output ran out of tokens mid-call) it is dropped after whole calls, so they stand."""
        objects = []
        blocks = calls.split(START)[1:]
        for i, block in enumerate(blocks):
            body, closed, _ = block.partition(END)
            if partial:
                objects += self.partial_objects(body)
                continue
            try:
                objects.append(json.loads(body))
            except ValueError:
                if closed or i < len(blocks) - 1 or not objects:
                    raise
        return objects

    def call_tag(self, tool: Tool) -> dict[str, Any]:
        return self.object_tag(tool, START + "\n", "\n" + END)
