"""Pydantic models of the OpenAI requests the gateway accepts (/v1/completions, /v1/chat/completions).

Fields follow the OpenAI API plus the sampling extras vLLM and SGLang accept (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, skip_special_tokens, stop_token_ids,
include_stop_str_in_output, ...) and the constrained-decoding forms (``response_format``, vLLM's
``structured_outputs``; ``structured_outputs.py``). As vLLM does, unknown top-level fields (and
unknown fields of messages) are accepted and ignored, and the serving modules log them
(``unknown_fields``); known fields the runtime cannot honour (audio output, web search, legacy
``functions``) fail validation naming the field. OpenAI fields that do not change what is generated
(``store``, ``metadata``, ``service_tier``, ``reasoning_effort``, ``prediction``,
``prompt_cache_key``, ``safety_identifier``, ``verbosity``) are accepted and ignored. Float fields
must be finite (no NaN / inf).

Cross-field errors are raised as ``PydanticCustomError(..., {"param": name})`` so the error handler
can report ``param``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from pdserve.sampling.bounds import (
    INT32_MAX,
    MAX_JSON_DEPTH,
    MAX_N,
    MAX_PRIORITY,
    MAX_SPECULATIVE_DRAFT_TOKENS,
    MAX_TEMPLATE_KWARGS_CHARS,
    MAX_TOOLS,
    MAX_TOOLS_CHARS,
    MAX_TOP_LOGPROBS,
    json_depth,
)
from pdserve.services.gateway.io_struct import ChatPrompt, SamplingParams
from pdserve.services.gateway.openai.protocol_fields import (
    LogitBias,
    PositiveFloat32,
    RequestModel,
    Seed,
    Stop,
    StopTokenIds,
    TokenCount,
    TopK,
    check_stop,
    param_error,
    unsupported,
)
from pdserve.services.gateway.openai.protocol_tools import AssistantToolCall, ToolChoice, ToolDef
from pdserve.services.gateway.openai.structured_outputs import (
    Constraint,
    ResponseFormat,
    StructuredOutputs,
    request_constraint,
)


class StreamOptions(RequestModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAIRequest(RequestModel):
    """Fields shared by completions and chat completions (sampling, stopping, streaming, constraints)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    max_tokens: TokenCount | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    # vLLM / SGLang sampling extras.
    top_k: TopK | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: PositiveFloat32 | None = None
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_token_ids: StopTokenIds | None = None
    include_stop_str_in_output: bool = False
    # constrained decoding (OpenAI's and vLLM's forms)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # speculative decoding: the most drafts verified per step (0 opts out; unset: the server's)
    speculative_num_draft_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_DRAFT_TOKENS)
    # vLLM's prompt logprobs: each prompt token's logprob (but the first's) and this many top ones
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's priority: lower is served first; not 0 only under --schedule-policy priority (else 400)
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    # OpenAI fields that do not change the output: accepted and ignored.
    prompt_cache_key: str | None = Field(None, max_length=1024)
    safety_identifier: str | None = Field(None, max_length=1024)
    _constraint: Constraint | None = PrivateAttr(None)

    @field_validator("stop")
    @classmethod
    def _stop_within_bounds(cls, v: str | list[str] | None) -> str | list[str] | None:
        return check_stop(v, "stop")

    @model_validator(mode="after")
    def _check_shared(self):
        if self.stream_options is not None and not self.stream:
            raise param_error("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if self.prompt_logprobs is not None and self.stream:
            raise param_error("prompt_logprobs", "'prompt_logprobs' are not available when 'stream' is true")
        limit = self.max_new_tokens
        if limit is not None and self.min_tokens > limit:
            raise param_error("min_tokens", f"min_tokens ({self.min_tokens}) exceeds max_tokens ({limit})")
        self._constraint = request_constraint(self.response_format, self.structured_outputs)
        if self._constraint is not None and self.ignore_eos:
            raise param_error("ignore_eos", "'ignore_eos' cannot be combined with a constrained output")
        return self

    @property
    def constraint(self) -> Constraint | None:
        """The grammar ``response_format`` or ``structured_outputs`` asks for, if any."""
        return self._constraint

    def unknown_fields(self) -> list[str]:
        """Fields of the request this server does not know (accepted and ignored), dotted."""
        return sorted(self.model_extra or {})

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The top prompt logprobs the runtime computes (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def sampling_params(
        self, return_logprob: bool, top_logprobs_num: int, constraint: Constraint | None = None
    ) -> SamplingParams:
        """The runtime's sampling parameters of this request (``max_new_tokens`` None = default),
        its output held to ``constraint`` when one is given."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        grammar = {constraint.kind: constraint.text} if constraint is not None else {}
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_tokens or None,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids or []),
            stop=stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
            seed=self.seed,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            prompt_logprobs=self.engine_prompt_logprobs,
            logit_bias=dict(self.logit_bias or {}),
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
            priority=self.priority,
            **grammar,
        )


class CompletionRequest(_OpenAIRequest):
    """POST /v1/completions. ``prompt``: a string, a list of strings (a batch), token ids, or a
    list of token-id lists. Choice ``j * n + i`` is sample i of prompt j. Token ids are checked
    against the vocabulary by the ``RequestManager`` (negative ones included).

    ``echo`` with ``logprobs`` scores the prompt too (OpenAI's legacy form, which evaluation
    harnesses read): the runtime computes prompt logprobs with ``logprobs`` top alternatives.
    ``max_tokens`` 0 is accepted with ``echo`` only: the prompt alone comes back (one token is
    generated and dropped)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list | str) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("'suffix' is not supported")
        return v

    @model_validator(mode="after")
    def _check_completion(self):
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "best_of must be unset or equal to n")
        if self.max_tokens == 0 and not self.echo:
            raise param_error("max_tokens", "'max_tokens' 0 needs 'echo' true (the prompt alone is returned)")
        return self

    @property
    def prompt_only(self) -> bool:
        """``max_tokens`` 0: the response holds the echoed prompt and nothing generated."""
        return self.max_tokens == 0

    @property
    def max_new_tokens(self) -> int | None:
        return 1 if self.prompt_only else self.max_tokens

    @property
    def scores_echo(self) -> bool:
        """``echo`` with ``logprobs``: the echoed prompt tokens carry logprobs."""
        return self.echo and self.logprobs is not None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        if not self.scores_echo:
            return self.prompt_logprobs
        return max(self.logprobs, self.prompt_logprobs or 0)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class ChatMessage(RequestModel):
    """One chat message; content is text or a list of ``{"type": "text", "text": ...}`` parts.

    An assistant message may carry the ``tool_calls`` it made (then its content may be null), a
    ``tool`` message the result of the call ``tool_call_id``. Unknown fields (a client echoing a
    response's ``refusal`` or ``annotations``) are ignored.
    """

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256)
    reasoning_content: str | None = None  # an earlier answer's reasoning, sent back: not rendered

    @field_validator("content", mode="after")
    @classmethod
    def _text_parts(cls, v: str | list[dict[str, Any]] | None) -> str | None:
        if not isinstance(v, list):
            return v
        texts = []
        for part in v:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part type {part.get('type')!r} is not supported (text only)")
            texts.append(part["text"])
        return "".join(texts)

    @model_validator(mode="after")
    def _check_message(self):
        if self.tool_calls and self.role != "assistant":
            raise param_error("tool_calls", "only an assistant message carries 'tool_calls'")
        if self.tool_call_id is not None and self.role != "tool":
            raise param_error("tool_call_id", "only a tool message carries 'tool_call_id'")
        if self.content is None and not (self.role == "assistant"):
            raise param_error("content", f"a {self.role} message needs 'content'")
        return self

    def as_dict(self) -> dict[str, str]:
        """The ``pdserve.v1.ChatMessage`` fields for the chat template; 'developer' renders as 'system'."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls_json"] = json.dumps([c.model_dump() for c in self.tool_calls])
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


def _check_depth(param: str, value: Any) -> None:
    """Refuse JSON nested deeper than ``MAX_JSON_DEPTH`` (the chat template recurses per level)."""
    if (depth := json_depth(value)) > MAX_JSON_DEPTH:
        raise param_error(param, f"{param} nests {depth} levels deep; at most {MAX_JSON_DEPTH}")


class ChatInput(RequestModel):
    """What a chat request hands to the chat template: messages, tools and template options.

    /v1/chat/completions and the gRPC API's ``chat`` input both validate through this model, so
    they take the same messages and tools: at least one message (see ``ChatMessage``); at most
    ``MAX_TOOLS`` tools, ``MAX_TOOLS_CHARS`` characters of JSON in all (the gRPC API sends its tools
    with ``tool_choice='none'``: shown to the template, never parsed); tools and
    ``chat_template_kwargs`` nested at most ``MAX_JSON_DEPTH`` levels, the kwargs at most
    ``MAX_TEMPLATE_KWARGS_CHARS`` characters of JSON; ``continue_final_message``
    only with ``add_generation_prompt`` false and an assistant message last (as vLLM; the last user
    turn "continued" would give an empty answer).
    """

    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    # vLLM chat extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _tools_within_bounds(cls, v: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) < len(names):
            twice = next(name for name in names if names.count(name) > 1)
            raise param_error("tools", f"two tools are named {twice!r}: a tool call names one")
        tools = [t.model_dump(exclude_none=True) for t in v] if v else []
        _check_depth("tools", tools)  # first: json.dumps recurses per level too
        size = len(json.dumps(tools))
        if size > MAX_TOOLS_CHARS:
            raise param_error("tools", f"the tools have {size} characters as JSON; at most {MAX_TOOLS_CHARS}")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs_within_bounds(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        _check_depth("chat_template_kwargs", v)  # first: json.dumps recurses per level too
        size = len(json.dumps(v)) if v else 0
        if size > MAX_TEMPLATE_KWARGS_CHARS:
            raise param_error(
                "chat_template_kwargs",
                f"chat_template_kwargs has {size} characters as JSON; at most {MAX_TEMPLATE_KWARGS_CHARS}",
            )
        return v

    @model_validator(mode="after")
    def _check_template_input(self):
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise param_error("tool_choice", "'tool_choice' names a tool call but 'tools' is empty")
        if self.add_generation_prompt and self.continue_final_message:
            raise param_error(
                "continue_final_message", "'continue_final_message' needs 'add_generation_prompt' false"
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise param_error(
                "continue_final_message",
                "'continue_final_message' continues the last message, which must be the assistant's "
                f"(it is the {self.messages[-1].role}'s)",
            )
        return self

    def chat_prompt(self) -> ChatPrompt:
        """The prompt for the tokenizer service (messages as ``ChatMessage.as_dict`` renders them)."""
        return ChatPrompt(
            messages=[m.as_dict() for m in self.messages],
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            tools_json=json.dumps([t.model_dump(exclude_none=True) for t in self.tools])
            if self.tools
            else "",
            chat_template_kwargs_json=json.dumps(self.chat_template_kwargs)
            if self.chat_template_kwargs
            else "",
        )


class ChatCompletionRequest(ChatInput, _OpenAIRequest):
    """POST /v1/chat/completions: ``ChatInput`` plus sampling, logprob and output options."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: TokenCount | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # OpenAI fields that do not change the output: accepted and ignored.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None  # a hint; reasoning is the model's (see --reasoning-parser)
    prediction: dict[str, Any] | None = None  # a speed hint (predicted output) only
    verbosity: Literal["low", "medium", "high"] | None = None
    # OpenAI fields that would change the output: only their no-op values are accepted.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.functions or self.function_call not in (None, "none"):
            raise unsupported(
                "functions" if self.functions else "function_call",
                "legacy function calling is not served; send 'tools' and 'tool_choice' instead",
            )
        if self.top_logprobs and not self.logprobs:
            raise param_error("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
        self._check_output_kind()
        return self

    def unknown_fields(self) -> list[str]:
        messages = [
            f"messages.{i}.{name}"
            for i, m in enumerate(self.messages)
            for name in sorted(m.model_extra or {})
        ]
        return super().unknown_fields() + messages

    def _check_output_kind(self) -> None:
        """Text output only: no audio, no web search (raises a named-field error otherwise)."""
        if self.modalities is not None and self.modalities != ["text"]:
            raise param_error(
                "modalities",
                f"'modalities' must be ['text'] (got {self.modalities}): this server generates text only",
            )
        if self.audio is not None:
            raise unsupported("audio", "this server generates text only (no audio output)")
        if self.web_search_options is not None:
            raise unsupported("web_search_options", "this server does not search the web")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
