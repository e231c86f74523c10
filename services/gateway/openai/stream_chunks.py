"""The SSE chunks of streamed OpenAI responses, encoded straight to JSON bytes.

A stream sends one chunk per step of every request, so a chunk is built as a plain dict and
encoded with orjson: the same JSON the pydantic models of ``protocol_responses`` give
(``CompletionChunk``, ``ChatCompletionChunk``; the tests compare them), without validating each
chunk the gateway itself built. Nested parts that are rare in a stream (logprobs, usage) are the
pydantic models' ``model_dump()``.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from pydantic import BaseModel


class ChunkEncoder:
    """Encodes the chunks of one stream (``kind`` ``"text_completion"`` or ``"chat.completion.chunk"``);
    every chunk of a stream has the same ``id``, ``model`` and ``created``."""

    __slots__ = ("chunk_id", "created", "kind", "model")

    def __init__(self, kind: str, chunk_id: str, model: str) -> None:
        self.kind, self.chunk_id, self.model = kind, chunk_id, model
        self.created = int(time.time())

    def encode(self, choices: list[dict[str, Any]], usage: BaseModel | None = None) -> bytes:
        return orjson.dumps(
            {
                "id": self.chunk_id,
                "object": self.kind,
                "created": self.created,
                "model": self.model,
                "choices": choices,
                "usage": None if usage is None else usage.model_dump(),
            }
        )


def _dump(model: BaseModel | None) -> dict | None:
    return None if model is None else model.model_dump()


def completion_choice(
    index: int,
    text: str,
    logprobs: BaseModel | None = None,
    finish_reason: str | None = None,
    matched_stop: str | int | None = None,
) -> dict[str, Any]:
    """A ``CompletionChoice`` of a text-completion chunk."""
    return {
        "index": index,
        "text": text,
        "logprobs": _dump(logprobs),
        "finish_reason": finish_reason,
        "matched_stop": matched_stop,
    }


def chat_choice(
    index: int,
    content: str | None,
    role: str | None = None,
    logprobs: BaseModel | None = None,
    finish_reason: str | None = None,
    matched_stop: str | int | None = None,
    reasoning_content: str | None = None,
    tool_calls: list[BaseModel] | None = None,
) -> dict[str, Any]:
    """A ``ChatChunkChoice``: ``delta`` has the role (first chunk), the new content, reasoning and
    tool-call pieces (``DeltaToolCall``s; each None when none)."""
    calls = [c.model_dump() for c in tool_calls] if tool_calls else None
    return {
        "index": index,
        "delta": {
            "role": role,
            "content": content,
            "reasoning_content": reasoning_content,
            "tool_calls": calls,
        },
        "logprobs": _dump(logprobs),
        "finish_reason": finish_reason,
        "matched_stop": matched_stop,
    }
