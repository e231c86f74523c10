"""``ToolCallStream``: one choice's tool calls as OpenAI ``delta.tool_calls`` pieces, while it streams.

Each new piece of text is added to what came before and re-read with the format's partial parse:
text before the calls goes out as content as soon as it cannot be the start of a call; a call goes
out first as its id and name (once the name is complete), then as pieces of its arguments. A piece
is sent only when it is a prefix of the arguments' final text (``json.dumps`` of the object so
far, less the brackets still open), so the pieces concatenate to exactly the non-streamed
``arguments``; ``finish`` sends whatever the whole-output parse adds at the end.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from pdserve.services.gateway.openai.tool_parsers.base import ToolCall, ToolParser

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ToolCallDelta:
    """One piece of call ``index``: its first piece has ``id`` and ``name``, later ones neither."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolCallStream:
    """Incremental parse of one choice's text with ``parser``; at most ``limit`` calls are reported
    (None: all; 1 when the request turned ``parallel_tool_calls`` off)."""

    def __init__(self, parser: ToolParser, limit: int | None = None) -> None:
        self.parser = parser
        self.limit = limit
        self.text = ""
        self._content_sent = 0
        self._calls_start: int | None = None
        self._content_end: int | None = None
        self._sent: list[ToolCall] = []  # per call: its id, name and the arguments sent so far

    @property
    def called(self) -> bool:
        """Whether any tool call has been sent."""
        return bool(self._sent)

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Add ``delta``; returns ``(content, tool-call pieces)`` ready to send."""
        self.text += delta
        if self._calls_start is None:
            found = self.parser.find_calls(self.text)
            if found is None:
                return self._content(len(self.text) - self.parser.undecided_tail(self.text)), []
            self._content_end, self._calls_start = found
        content = self._content(self._content_end)
        objects = self.parser.call_objects(self.text[self._calls_start :], partial=True)
        pieces = [self._advance(i, obj, i < len(objects) - 1) for i, obj in enumerate(objects)]
        return content, [p for p in pieces if p is not None]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the output: the content or argument pieces still unsent."""
        calls = self.parser.parse(self.text).tool_calls[: self.limit]
        if not calls:
            if self._sent:
                logger.warning("streamed tool calls did not parse at the end: %.200r", self.text)
                return "", []
            return self._content(len(self.text)), []
        pieces = []
        for i, call in enumerate(calls):
            if i == len(self._sent):
                self._sent.append(ToolCall(call.name, "", call.id))
                pieces.append(ToolCallDelta(i, call.id, call.name))
            sent = self._sent[i].arguments
            if call.arguments.startswith(sent) and call.arguments != sent:
                pieces.append(ToolCallDelta(i, arguments=call.arguments[len(sent) :]))
        return "", pieces

    def _content(self, end: int) -> str:
        """Content up to ``end`` not sent yet; none while everything so far is whitespace."""
        if end <= self._content_sent or not self.text[:end].strip():
            return ""
        piece, self._content_sent = self.text[self._content_sent : end], end
        return piece

    def _advance(self, index: int, obj: Any, complete: bool) -> ToolCallDelta | None:
        if self.limit is not None and index >= self.limit:
            return None
        name, arguments = self.parser.fields(obj)
        piece = None
        if index == len(self._sent):
            if not isinstance(name, str) or not name:
                return None
            call = ToolCall(name, "")
            self._sent.append(call)
            piece = ToolCallDelta(index, call.id, name)
        if arguments is None:
            return piece
        text = json.dumps(arguments, ensure_ascii=False)
        if not complete:
            text = text.rstrip("]}")
        sent = self._sent[index]
        if not text.startswith(sent.arguments) or text == sent.arguments:
            return piece
        self._sent[index] = ToolCall(sent.name, text, sent.id)
        added = text[len(sent.arguments) :]
        if piece is None:
            return ToolCallDelta(index, arguments=added)
        piece.arguments = added
        return piece
