"""Building ``pdserve.v1.GenerateRequest`` messages from the clients' arguments."""

from __future__ import annotations

import json
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from pdserve_sdk import _wire


class SamplingKwargs(TypedDict, total=False):
    """Sampling parameters (``pdserve.v1.SamplingParams``); unset ones take the server's defaults.

    ``temperature=0`` is greedy; ``max_new_tokens`` counts generated tokens; ``stop`` strings are
    matched on the output text; ``n`` > 1 asks for parallel samples; with ``return_logprob`` each
    token carries its logprob (natural log) and ``top_logprobs_num`` alternatives; ``logit_bias``
    maps token ids to a value in [-100, 100] added to their logits before sampling. At most one of
    ``json_schema`` (a JSON Schema, as a dict or JSON text), ``regex``, ``ebnf`` (a grammar whose
    start rule is ``root``) and ``structural_tag`` (xgrammar's format, dict or JSON text) holds
    the output to a grammar. ``prompt_logprobs`` (vLLM's) returns each prompt token's logprob (but
    the first's) with that many alternatives, in the choice's ``prompt_logprobs``. ``priority``
    (vLLM's; lower is served first) needs a server run with ``--schedule-policy priority``.
    ``speculative_num_draft_tokens`` caps the draft tokens per step where the server speculates
    (0 opts out; never above the server's ``--speculative-num-draft-tokens``); the output is the same.
    """

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    max_new_tokens: int
    min_new_tokens: int
    ignore_eos: bool
    stop_token_ids: Sequence[int]
    stop: str | Sequence[str]
    include_stop_str_in_output: bool
    seed: int
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    n: int
    return_logprob: bool
    top_logprobs_num: int
    prompt_logprobs: int
    priority: int
    speculative_num_draft_tokens: int
    logit_bias: Mapping[int, float]
    json_schema: str | Mapping[str, Any]
    regex: str
    ebnf: str
    structural_tag: str | Mapping[str, Any]


class RequestKwargs(SamplingKwargs, total=False):
    """Per-request options of ``generate``/``stream``: the model id (default: the client's, then the
    server's) and a request id (default: the gateway makes one), plus the sampling parameters."""

    model: str
    rid: str


class ChatKwargs(RequestKwargs, total=False):
    """``RequestKwargs`` plus chat-template options: ``add_generation_prompt`` (default True),
    ``continue_final_message``, ``tools`` (JSON-able tool specs, shown to the chat template; tool
    calls are never parsed) and ``chat_template_kwargs``."""

    add_generation_prompt: bool
    continue_final_message: bool
    tools: Sequence[Mapping[str, Any]]
    chat_template_kwargs: Mapping[str, Any]


# OpenAI's names of sampling parameters the SDK spells as SGLang does, named in the unknown-name error
_OPENAI_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "logprobs": "return_logprob",
    "top_logprobs": "top_logprobs_num",
}


def sampling_params(sampling: Mapping[str, Any]) -> Any:
    """A ``SamplingParams`` message from ``SamplingKwargs``; ``None`` values are left unset.

    Raises:
        TypeError: on a name that is not a sampling parameter, or a value of the wrong type.
        ValueError: on a value the field cannot hold (e.g. an int beyond int32).
    """
    unknown = sorted(sampling.keys() - SamplingKwargs.__optional_keys__)
    if unknown:
        named = [f"{k} (the SDK's is {_OPENAI_NAMES[k]})" if k in _OPENAI_NAMES else k for k in unknown]
        raise TypeError(f"unknown parameter(s): {', '.join(named)}")
    params = _wire.SamplingParams()
    for name, value in sampling.items():
        if value is None:
            continue
        if name == "stop" and isinstance(value, str):
            value = [value]
        if name in ("json_schema", "structural_tag") and isinstance(value, Mapping):
            value = json.dumps(value)
        try:
            params.MergeFrom(_wire.SamplingParams(**{name: value}))
        except (TypeError, ValueError) as err:
            kind = TypeError if isinstance(err, TypeError) else ValueError  # not UnicodeEncodeError's 5 args
            raise kind(f"sampling parameter {name}={value!r}: {err}") from None
    return params


def generate_request(
    prompt: str | None, input_ids: Sequence[int] | None, default_model: str, kwargs: RequestKwargs
) -> Any:
    """A ``GenerateRequest`` for a text prompt or a list of token ids (exactly one of them).

    Raises:
        TypeError: when both or neither of ``prompt`` and ``input_ids`` are given, or on a bad kwarg.
    """
    if (prompt is None) == (input_ids is None):
        raise TypeError("pass exactly one of prompt and input_ids")
    request = _request(default_model, kwargs)
    if prompt is not None:
        request.text = prompt
    else:
        request.input_ids.ids.extend(input_ids)
    return request


def embed_request(
    inputs: str | Sequence[str] | Sequence[Sequence[int]],
    default_model: str,
    dimensions: int | None,
    model: str | None,
    rid: str,
) -> Any:
    """An ``EmbedRequest`` for a text, a list of texts or a list of token-id lists."""
    request = _wire.EmbedRequest(model=model or default_model, rid=rid, dimensions=dimensions or 0)
    for item in [inputs] if isinstance(inputs, str) else inputs:
        if isinstance(item, str):
            request.texts.append(item)
        else:
            request.input_ids.add().ids.extend(item)
    return request


_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def chat_request(messages: Sequence[Mapping[str, Any]], default_model: str, kwargs: ChatKwargs) -> Any:
    """A ``GenerateRequest`` whose prompt is ``messages`` rendered by the model's chat template.

    ``messages`` are ``{"role", "content"}`` dicts (optionally with ``"name"``; an assistant turn
    with the ``"tool_calls"`` it made, a ``"tool"`` turn with the ``"tool_call_id"`` it answers, as in
    OpenAI's API); ``content`` is a string or, as in OpenAI's API, a list of ``{"type": "text",
    "text": ...}`` parts, which are sent joined without a separator (what the HTTP API renders them
    as). The server checks the messages and ``tools`` as /v1/chat/completions does with
    ``tool_choice='none'``: known roles, tools shown to the template and never parsed.

    Raises:
        TypeError: when a message is not such a dict or a value has the wrong type, or on a bad kwarg.
        ValueError: on a content part that is not a text part.
        Both name the message by its index (``messages[1]``).
    """
    options: dict[str, Any] = dict(kwargs)
    tools = options.pop("tools", None)
    template_kwargs = options.pop("chat_template_kwargs", None)
    chat = _wire.ChatMessages(
        add_generation_prompt=options.pop("add_generation_prompt", True),
        continue_final_message=options.pop("continue_final_message", False),
        tools_json=json.dumps(list(tools)) if tools else "",
        chat_template_kwargs_json=json.dumps(dict(template_kwargs)) if template_kwargs else "",
    )
    for i, message in enumerate(messages):
        try:
            chat.messages.add(**_message_fields(message))
        except (TypeError, ValueError) as err:  # ValueError covers protobuf's UnicodeEncodeError
            kind = TypeError if isinstance(err, TypeError) else ValueError
            raise kind(f"messages[{i}]: {err}") from None
    request = _request(default_model, options)
    request.chat.CopyFrom(chat)
    return request


def _message_fields(message: Any) -> dict[str, str]:
    """The ``pdserve.v1.ChatMessage`` fields of one message (strings; content parts joined; tool
    calls as JSON text)."""
    if not isinstance(message, Mapping) or not {"role", "content"} <= message.keys() <= _MESSAGE_KEYS:
        shape = sorted(message) if isinstance(message, Mapping) else type(message).__name__
        raise TypeError(
            "a chat message has keys role, content and optionally name, tool_calls, tool_call_id; "
            f"got {shape}"
        )
    fields = {**message, "content": _content_text(message["content"])}
    if "tool_calls" in fields:
        fields["tool_calls_json"] = json.dumps(list(fields.pop("tool_calls")))
    for key, value in fields.items():
        if not isinstance(value, str):
            raise TypeError(f"{key} must be a string, got {type(value).__name__}")
    return fields


def _content_text(content: Any) -> str:
    """A message's ``content`` as sent: a string as is, text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list | tuple):
        raise TypeError(f"content must be a string or a list of text parts, got {type(content).__name__}")
    for j, part in enumerate(content):
        if not (
            isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
        ):
            raise ValueError(
                f"content[{j}] is not a text part {{'type': 'text', 'text': str}}: {reprlib.repr(part)}"
            )
    return "".join(part["text"] for part in content)


def _request(default_model: str, kwargs: Mapping[str, Any]) -> Any:
    """A ``GenerateRequest`` with model, rid and sampling parameters from ``kwargs``, and no input yet."""
    sampling = dict(kwargs)
    return _wire.GenerateRequest(
        model=sampling.pop("model", default_model),
        rid=sampling.pop("rid", ""),
        sampling_params=sampling_params(sampling),
    )
