"""Pydantic models of the OpenAI responses and stream chunks the gateway sends back.

``matched_stop`` (the stop string or stop token id that ended a choice) is SGLang's extra field;
OpenAI clients ignore it.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


def _now() -> int:
    return int(time.time())


# ---- chat -------------------------------------------------------------------------------------


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class CalledFunction(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: str | int | None = None


class PromptLogprobEntry(BaseModel):
    """vLLM's ``Logprob`` of one token at one prompt position; ``rank`` (1 = most likely) is null
    for a prompt token outside the position's top alternatives."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# vLLM's ``prompt_logprobs``: null for the first prompt token, then token id -> entry per position
PromptLogprobs = list[dict[str, PromptLogprobEntry] | None]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str = ""


class DeltaToolCall(BaseModel):
    """A piece of tool call ``index``: the first carries ``id``, ``type`` and the name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


# ---- completions ------------------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs; an echoed prompt's first token has null ``token_logprobs`` and
    ``top_logprobs`` (nothing precedes it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: str | int | None = None


class CompletionChoice(CompletionStreamChoice):
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's; never streamed (a streamed request is a 400)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


# ---- models -----------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pdserve"
    max_model_len: int | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for the base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
