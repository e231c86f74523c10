"""The Response object of the Responses API: what /v1/responses answers, streams in its
``response.*`` events and keeps in the store; and the output items a chat choice becomes.

A choice's text, split by the chat parsers (``ChoiceOutput``), becomes up to three kinds of items,
in this order: a ``reasoning`` item (with a reasoning parser), a ``message`` item with one
``output_text`` part (present unless the output is only tool calls), and a ``function_call`` item
per call. The response's ``status`` follows the choice's finish reason: ``completed``
("stop"), ``incomplete`` with ``incomplete_details.reason`` "max_output_tokens" ("length"),
``cancelled`` ("abort"); ``failed`` with ``error`` when generation failed.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from pdserve.services.gateway.openai.chat_output import ChoiceOutput
from pdserve.services.gateway.openai.responses.items import (
    FunctionCallItem,
    Item,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    item_id,
)
from pdserve.services.gateway.openai.responses.protocol import ResponsesRequest

Status = Literal["completed", "failed", "in_progress", "cancelled", "incomplete"]
_STATUS = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> ResponseUsage:
        return cls(
            input_tokens=prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] | None = None


class ResponseObject(BaseModel):
    """OpenAI's ``Response``: the request's settings echoed, the output items, status and usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Status
    model: str
    output: list[Any] = Field(default_factory=list)  # Item models (dumped as they are)
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] = Field(default_factory=dict)
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    background: bool = False
    service_tier: str = "default"
    user: str | None = None
    usage: ResponseUsage | None = None

    @classmethod
    def start(cls, response_id: str, model: str, body: ResponsesRequest) -> ResponseObject:
        """The ``in_progress`` response of ``body``, served as ``model``, with no output yet."""
        choice = body.tool_choice
        return cls(
            id=response_id,
            created_at=int(time.time()),
            status="in_progress",
            model=model,
            instructions=body.instructions,
            metadata=body.metadata or {},
            tools=[t.model_dump() for t in body.tools],
            tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
            parallel_tool_calls=body.parallel_tool_calls,
            max_output_tokens=body.max_output_tokens,
            max_tool_calls=body.max_tool_calls,
            temperature=body.temperature,
            top_p=body.top_p,
            top_logprobs=body.top_logprobs,
            previous_response_id=body.previous_response_id,
            text=body.text.model_dump(by_alias=True, exclude_none=True),
            reasoning=body.reasoning.model_dump() if body.reasoning else None,
            store=body.store,
            user=body.user,
        )

    def finish(self, output: list[Item], finish_reason: str | None, usage: ResponseUsage) -> None:
        """Set the output, the status of ``finish_reason`` and the usage (now completed)."""
        self.output = output
        self.status = _STATUS.get(finish_reason or "stop", "completed")
        if finish_reason == "length":
            self.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        self.usage = usage
        self.completed_at = int(time.time())

    def fail(self, code: str, message: str) -> None:
        self.status = "failed"
        self.error = ResponseError(code=code, message=message)

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def output_items(out: ChoiceOutput, finish_reason: str | None, logprobs: list | None) -> list[Item]:
    """The output items of one whole choice (see the module docstring); ``logprobs``: its tokens'
    entries (Responses' shape) when the request asked for them, else None."""
    items: list[Item] = []
    if out.reasoning:
        items.append(reasoning_item(item_id("rs"), out.reasoning, "completed"))
    if out.content or not out.tool_calls:  # a cut output's message is incomplete, unless calls follow it
        cut = finish_reason == "length" and not out.tool_calls
        items.append(
            message_item(item_id("msg"), out.content or "", "incomplete" if cut else "completed", logprobs)
        )
    for call in out.tool_calls:
        call_item = FunctionCallItem(
            id=item_id("fc"), call_id=call.id, name=call.name, arguments=call.arguments, status="completed"
        )
        items.append(call_item)
    return items


def message_item(id_: str, text: str | None, status: str, logprobs: list | None = None) -> MessageItem:
    """An assistant message; ``text`` None: no content part yet (as ``output_item.added`` sends it)."""
    parts = [] if text is None else [OutputText(type="output_text", text=text, logprobs=logprobs or [])]
    return MessageItem(id=id_, role="assistant", content=parts, status=status)


def reasoning_item(id_: str, text: str | None, status: str) -> ReasoningItem:
    content = [] if text is None else [ReasoningText(text=text)]
    return ReasoningItem(id=id_, content=content, status=status)
