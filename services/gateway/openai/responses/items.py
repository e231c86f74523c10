"""The items of a Responses conversation (OpenAI's ``input`` items and ``output`` items), and the
chat messages they become.

One set of models serves both directions, because OpenAI's output items are valid input items: a
client sends a response's ``output`` back as the next ``input``, and the store keeps a
conversation as these items. Served: ``message`` items (roles ``user``, ``system``, ``developer``,
``assistant``; content as text or ``input_text`` / ``output_text`` / ``refusal`` parts; the
``type`` may be left out), ``function_call``, ``function_call_output`` and ``reasoning`` (kept, not
rendered, as chat's ``reasoning_content``). Any other item type, and image, audio or file parts,
are a 400 naming the item.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from pdserve.sampling.bounds import MAX_GRAMMAR_CHARS
from pdserve.services.gateway.openai.protocol_fields import RequestModel
from pdserve.services.gateway.openai.protocol_tools import ToolName

MAX_ID_CHARS = 256  # item ids and call ids (as chat's tool_call_id)
MAX_PARTS = 1024  # content parts of one message or one call output
MAX_LOGPROBS = 1 << 16  # logprob entries of an output text a client sends back (ignored)
Status = Literal["in_progress", "completed", "incomplete"]


def item_id(prefix: str) -> str:
    """A new item id such as ``msg_<hex>``, ``fc_<hex>``, ``rs_<hex>``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class _Item(RequestModel):
    model_config = ConfigDict(extra="ignore")


class InputText(_Item):
    type: Literal["input_text"]
    text: str


class OutputText(_Item):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_PARTS)
    logprobs: list[dict[str, Any]] | None = Field(None, max_length=MAX_LOGPROBS)


class Refusal(_Item):
    type: Literal["refusal"]
    refusal: str


TextPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]
Parts = Annotated[list[TextPart], Field(max_length=MAX_PARTS)]


def parts_text(content: str | list[TextPart]) -> str:
    """The text of a content given as text or as parts (joined)."""
    if isinstance(content, str):
        return content
    return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in content)


class MessageItem(_Item):
    """A message; ``type`` may be left out (OpenAI's "easy" input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Parts
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    status: Status | None = None


class FunctionCallItem(_Item):
    """A call the model made: ``call_id`` is what its result refers to."""

    type: Literal["function_call"] = "function_call"
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: str = ToolName
    arguments: str = Field(max_length=MAX_GRAMMAR_CHARS)
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    status: Status | None = None


class FunctionCallOutputItem(_Item):
    """The result of call ``call_id``, sent back by the client."""

    type: Literal["function_call_output"] = "function_call_output"
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    output: str | Parts
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    status: Status | None = None


class ReasoningText(_Item):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Item):
    """The model's reasoning (a reasoning parser's ``reasoning_content``); not shown to the model again."""

    type: Literal["reasoning"] = "reasoning"
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    summary: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_PARTS)
    content: list[ReasoningText] | None = Field(None, max_length=MAX_PARTS)
    status: Status | None = None


def _item_type(value: Any) -> str | None:
    """An item's tag: its ``type`` ("message" when left out); None (a 400) when not a string."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else None


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


def chat_messages(items: list[Item]) -> list[dict[str, Any]]:
    """The chat messages (``ChatMessage`` fields) of ``items``: a ``function_call`` joins the
    assistant message before it (or starts one), so a turn's text and parallel calls are one
    assistant message; a ``function_call_output`` is a ``tool`` message; reasoning is left out."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": parts_text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": parts_text(item.output)}
            )
    return messages
