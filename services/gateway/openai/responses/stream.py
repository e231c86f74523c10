"""The typed server-sent events of a streamed response, as OpenAI sends them and the official
client parses them (``ResponseStreamEvent``); each carries ``type`` and a ``sequence_number``.

``response.created`` and ``response.in_progress`` open the stream. Each output item then opens
with ``response.output_item.added`` and closes with ``response.output_item.done``: a message item
has one ``output_text`` part (``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``), a reasoning item one
``reasoning_text`` part (``response.reasoning_text.delta`` / ``.done``), a function call its
``response.function_call_arguments.delta`` pieces and ``.done``. A message or reasoning item closes
when the next item opens; calls close at the end, in order. The stream ends with
``response.completed`` (or ``response.incomplete``) carrying the whole response, whose output
items equal the non-streamed ones; a failure ends it with an ``error`` event and
``response.failed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.openai.responses.items import FunctionCallItem, Item, item_id
from pdserve.services.gateway.openai.responses.objects import (
    ResponseObject,
    ResponseUsage,
    message_item,
    reasoning_item,
)
from pdserve.services.gateway.openai.tool_parsers import ToolCallDelta

Event = tuple[str, bytes]  # (event type, JSON data)


@dataclass(slots=True)
class _OpenItem:
    """An output item being streamed: ``kind`` "message", "reasoning" or "call"."""

    kind: str
    id: str
    output_index: int
    text: str = ""  # the message's or reasoning's text, or the call's arguments
    call_id: str = ""
    name: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    status: str = "in_progress"  # "completed" or "incomplete" once closed

    def item(self, status: str) -> Item:
        """This item as it stands, with ``status`` ("in_progress" with no content part yet)."""
        opening = status == "in_progress"
        if self.kind == "message":
            return message_item(self.id, None if opening else self.text, status, self.logprobs)
        if self.kind == "reasoning":
            return reasoning_item(self.id, None if opening else self.text, status)
        return FunctionCallItem(
            id=self.id, call_id=self.call_id, name=self.name, arguments=self.text, status=status
        )


class ResponseStream:
    """The events of one streamed ``response`` (``start``, ``feed`` per piece, then ``finish`` or
    ``fail``)."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.sequence = 0
        self.items: list[_OpenItem] = []
        self._calls: dict[int, _OpenItem] = {}  # by the parser's call index
        self._pending_logprobs: list[dict[str, Any]] = []

    def start(self) -> list[Event]:
        return [self._response_event("response.created"), self._response_event("response.in_progress")]

    def feed(
        self, reasoning: str, content: str, calls: list[ToolCallDelta], logprobs: list[dict[str, Any]]
    ) -> list[Event]:
        """Events for the next piece of the output: its reasoning, content and call pieces (as
        ``ChoiceParser.feed`` splits them) and its tokens' logprob entries (when asked for: they go
        with the next text delta)."""
        events: list[Event] = []
        self._pending_logprobs += logprobs
        if reasoning:
            item = self._current("reasoning", events)
            item.text += reasoning
            events.append(
                self._item_event("response.reasoning_text.delta", item, content_index=0, delta=reasoning)
            )
        if content:
            item = self._current("message", events)
            item.text += content
            item.logprobs += self._pending_logprobs
            events.append(
                self._item_event(
                    "response.output_text.delta",
                    item,
                    content_index=0,
                    delta=content,
                    logprobs=self._pending_logprobs,
                )
            )
            self._pending_logprobs = []
        for piece in calls:
            if piece.index not in self._calls:
                self._close_open(events)
                call = _OpenItem(
                    "call", item_id("fc"), len(self.items), call_id=piece.id or "", name=piece.name or ""
                )
                self._open(call, events)
                self._calls[piece.index] = call
            call = self._calls[piece.index]
            if piece.arguments:
                call.text += piece.arguments
                events.append(
                    self._item_event("response.function_call_arguments.delta", call, delta=piece.arguments)
                )
        return events

    def finish(self, finish_reason: str | None, usage: ResponseUsage) -> list[Event]:
        """The closing events: every item still open, then the whole response."""
        events: list[Event] = []
        status = "incomplete" if finish_reason == "length" else "completed"
        if not any(item.kind in ("message", "call") for item in self.items):
            self._current("message", events)  # a response without calls always has a message
        if self.items and self.items[-1].kind == "message":
            self.items[-1].logprobs += self._pending_logprobs
        for item in self.items:
            if item.status == "in_progress":
                events += self._close(item, status)
        self.response.finish([item.item(item.status) for item in self.items], finish_reason, usage)
        kind = "response.completed" if self.response.status == "completed" else "response.incomplete"
        return events + [self._response_event(kind)]

    def fail(self, error: GatewayError) -> list[Event]:
        """An ``error`` event, then ``response.failed`` (generation failed after the stream began)."""
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        self.response.fail(code, error.message)
        event = self._event("error", code=error.code or code, message=error.message, param=error.param)
        return [event, self._response_event("response.failed")]

    # ---- items -------------------------------------------------------------------------------
    def _current(self, kind: str, events: list[Event]) -> _OpenItem:
        """The open item of ``kind`` (message or reasoning), opened now if the last one is another."""
        last = self.items[-1] if self.items else None
        if last is not None and last.kind == kind and last.status == "in_progress":
            return last
        self._close_open(events)
        item = _OpenItem(kind, item_id("msg" if kind == "message" else "rs"), len(self.items))
        self._open(item, events)
        return item

    def _open(self, item: _OpenItem, events: list[Event]) -> None:
        self.items.append(item)
        events.append(
            self._event(
                "response.output_item.added",
                output_index=item.output_index,
                item=item.item("in_progress").model_dump(),
            )
        )
        if item.kind != "call":
            events.append(
                self._item_event(
                    "response.content_part.added", item, content_index=0, part=self._part(item, "")
                )
            )

    def _close_open(self, events: list[Event]) -> None:
        """Close the open message or reasoning item (calls stay open until the end)."""
        for item in self.items:
            if item.status == "in_progress" and item.kind != "call":
                events += self._close(item, "completed")

    def _close(self, item: _OpenItem, status: str) -> list[Event]:
        item.status = "completed" if item.kind == "call" else status
        if item.kind == "call":
            events = [
                self._item_event(
                    "response.function_call_arguments.done", item, arguments=item.text, name=item.name
                )
            ]
        else:
            kind = "response.output_text.done" if item.kind == "message" else "response.reasoning_text.done"
            extra = {"logprobs": item.logprobs} if item.kind == "message" else {}
            events = [
                self._item_event(kind, item, content_index=0, text=item.text, **extra),
                self._item_event(
                    "response.content_part.done", item, content_index=0, part=self._part(item, item.text)
                ),
            ]
        final = item.item(item.status)
        events.append(
            self._event("response.output_item.done", output_index=item.output_index, item=final.model_dump())
        )
        return events

    @staticmethod
    def _part(item: _OpenItem, text: str) -> dict[str, Any]:
        if item.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        logprobs = item.logprobs if text else []
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    # ---- encoding ----------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> Event:
        data = orjson.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return kind, data

    def _item_event(self, kind: str, item: _OpenItem, **fields: Any) -> Event:
        return self._event(kind, item_id=item.id, output_index=item.output_index, **fields)

    def _response_event(self, kind: str) -> Event:
        return self._event(kind, response=self.response.dump())
