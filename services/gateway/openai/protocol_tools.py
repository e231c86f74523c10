"""Pydantic models of OpenAI's tool-calling request fields: ``tools``, ``tool_choice`` and an
assistant message's ``tool_calls`` (bounded by ``pdserve.sampling.bounds``: 128 tools, each one's
parameter schema and description at most 64 KiB characters, names as OpenAI allows them)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from pdserve.sampling.bounds import MAX_GRAMMAR_CHARS
from pdserve.services.gateway.openai.protocol_fields import RequestModel

ToolName = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")


class FunctionDef(RequestModel):
    """A function the model may call: its name, description and JSON Schema of parameters."""

    model_config = ConfigDict(extra="ignore")

    name: str = ToolName
    description: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema_within_bounds(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and (size := len(json.dumps(v))) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the schema has {size} characters as JSON; at most {MAX_GRAMMAR_CHARS}")
        return v


class ToolDef(RequestModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(RequestModel):
    model_config = ConfigDict(extra="ignore")

    name: str = ToolName


class NamedToolChoice(RequestModel):
    """``{"type": "function", "function": {"name": ...}}``: the model must call that function."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(RequestModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field("", max_length=MAX_GRAMMAR_CHARS)


class AssistantToolCall(RequestModel):
    """A call an earlier assistant turn made (sent back with the next turn)."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field("", max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction
