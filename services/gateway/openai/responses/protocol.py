"""POST /v1/responses: the request model, and the chat request it is served as.

A Responses request is served by the chat path (``serving_chat.start_chat``): ``instructions``
become a system message, then come the stored conversation of ``previous_response_id`` and the
``input`` items (``items.chat_messages``); ``tools`` (function tools), ``tool_choice``,
``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``, ``top_logprobs``,
``text.format`` and vLLM's ``priority`` map onto the chat fields of the same meaning. Every field
is bounded here; unknown fields are accepted and ignored (logged), as on the chat endpoint. Fields
that do not change the output (``metadata``, ``reasoning``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``,
``user``, ``text.verbosity``, ``stream_options``) are accepted and echoed or ignored; those that
would and are not served (``background``, ``conversation``, ``prompt``, ``truncation: "auto"``,
tools other than functions, ``allowed_tools`` choices) are a 400 naming the field.
``max_tool_calls`` bounds the calls a response reports (1: as ``parallel_tool_calls`` false).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from pdserve.sampling.bounds import MAX_GRAMMAR_CHARS, MAX_PRIORITY, MAX_TOOLS, MAX_TOP_LOGPROBS
from pdserve.services.gateway.errors import validate_as_body
from pdserve.services.gateway.openai.protocol import ChatCompletionRequest
from pdserve.services.gateway.openai.protocol_fields import RequestModel, TokenCount, param_error, unsupported
from pdserve.services.gateway.openai.protocol_tools import ToolName
from pdserve.services.gateway.openai.responses.items import MAX_ID_CHARS, Item, MessageItem, chat_messages

MAX_INPUT_ITEMS = 4096
MAX_METADATA = 16  # OpenAI's bounds of metadata: 16 pairs, keys <= 64 and values <= 512 characters
MAX_TEXT_FIELD_CHARS = 1024  # user, prompt_cache_key, safety_identifier
LOGPROBS_INCLUDE = "message.output_text.logprobs"
Includable = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class _Model(RequestModel):
    model_config = ConfigDict(extra="forbid")


class FunctionTool(_Model):
    """A function tool, as the Responses API writes it (flat: no ``function`` wrapper)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = ToolName
    description: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class FunctionChoice(_Model):
    type: Literal["function"]
    name: str = ToolName


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


class TextFormat(_Model):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its ``name`` and ``schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise param_error("text.format.schema", "text.format type 'json_schema' needs 'schema'")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """Chat's ``response_format`` of the same meaning (None for plain text)."""
        if self.type != "json_schema":
            return None if self.type == "text" else {"type": "json_object"}
        spec = {"name": self.name or "response", "schema": self.schema_}
        spec |= {
            k: v for k, v in (("description", self.description), ("strict", self.strict)) if v is not None
        }
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(_Model):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Model):
    """``reasoning``: hints (echoed, not applied: reasoning is the model's own)."""

    model_config = ConfigDict(extra="ignore")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(RequestModel):
    """POST /v1/responses (see the module docstring)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    input: str | Annotated[list[Item], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    store: bool = True
    stream: bool = False
    tools: list[FunctionTool] = Field(default_factory=list, max_length=MAX_TOOLS)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: TokenCount | None = None
    max_tool_calls: TokenCount | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's: lower is served first; not 0 only under --schedule-policy priority (else 400)
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    include: list[Includable] | None = Field(None, max_length=16)
    text: TextConfig = Field(default_factory=TextConfig)
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=MAX_METADATA)
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    stream_options: dict[str, bool] | None = Field(None, max_length=4)
    # accepted and ignored (they do not change the output)
    user: str | None = Field(None, max_length=MAX_TEXT_FIELD_CHARS)
    prompt_cache_key: str | None = Field(None, max_length=MAX_TEXT_FIELD_CHARS)
    safety_identifier: str | None = Field(None, max_length=MAX_TEXT_FIELD_CHARS)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # not served: only their no-op values are accepted
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_responses(self):
        if self.background:
            raise unsupported("background", "responses are served in the request that creates them")
        if self.conversation is not None:
            raise unsupported("conversation", "chain responses with 'previous_response_id' instead")
        if self.prompt is not None:
            raise unsupported("prompt", "send 'instructions' and 'input' instead")
        if self.truncation == "auto":
            raise unsupported("truncation", "an input over the model's context is a 400 ('disabled')")
        if self.stream_options is not None and not self.stream:
            raise param_error("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if self.tool_choice != "none" and self.tool_choice != "auto" and not self.tools:
            raise param_error("tool_choice", "'tool_choice' names a tool call but 'tools' is empty")
        return self

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)

    def input_items(self) -> list[Item]:
        """``input`` as items (a text input is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat_request(self, context: list[Item], inputs: list[Item]) -> ChatCompletionRequest:
        """The chat request this request is served as: ``context`` (the stored conversation of
        ``previous_response_id``: its items, input and output), then ``inputs`` (``input_items``).

        Raises:
            GatewayError: 400 where the chat fields do not validate (e.g. a tool message first).
        """
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += chat_messages(context + inputs)
        tools = [t.chat_tool() for t in self.tools]
        choice = self.tool_choice
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "tools": tools or None,
            "tool_choice": choice
            if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}},
            "parallel_tool_calls": self.parallel_tool_calls and self.max_tool_calls != 1,
            "stream": self.stream,
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
            "response_format": self.text.format.response_format(),
            "priority": self.priority,
        }
        optional = {
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        fields |= {k: v for k, v in optional.items() if v is not None}
        if not tools:
            del fields["tool_choice"], fields["parallel_tool_calls"]
        return validate_as_body(ChatCompletionRequest, fields)
