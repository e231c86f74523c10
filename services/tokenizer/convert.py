"""pdserve.v1 tokenizer messages <-> pdserve.tokenization calls."""

from __future__ import annotations

import json
from typing import Any

from pdserve.tokenization import ChatMessage, ChatTemplateError, Tokenizer, TokenizerInfo
from pdserve.v1 import tokenizer_pb2


def parse_json(field: str, text: str, expected: type) -> Any:
    """Parse an optional JSON field ("" = absent → None).

    Raises:
        ValueError: invalid JSON, or not of the ``expected`` type (list or dict).
    """
    if not text:
        return None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep to parse
        raise ValueError(f"{field} is not valid JSON: {e}") from e
    if not isinstance(value, expected):
        raise ValueError(f"{field} must be a JSON {expected.__name__}, got {type(value).__name__}")
    return value


def tokenize(tokenizer: Tokenizer, request: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
    """Serve one TokenizeRequest: plain text, or chat messages through the chat template.

    Raises:
        ValueError: no input set, bad JSON fields, or a chat the template cannot render.
    """
    kind = request.WhichOneof("input")
    if kind == "text":
        return tokenizer_pb2.TokenizeResponse(
            input_ids=tokenizer.encode(request.text, request.add_special_tokens)
        )
    if kind != "chat":
        raise ValueError("TokenizeRequest needs text or chat")
    chat = request.chat
    tools = parse_json("tools_json", chat.tools_json, list)
    kwargs = parse_json("chat_template_kwargs_json", chat.chat_template_kwargs_json, dict)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ChatTemplateError("tools_json must be a list of JSON objects")
    messages = []
    for i, m in enumerate(chat.messages):
        calls = parse_json(f"messages[{i}].tool_calls_json", m.tool_calls_json, list)
        if calls is not None and not all(isinstance(c, dict) for c in calls):
            raise ChatTemplateError(f"messages[{i}].tool_calls_json must be a list of JSON objects")
        messages.append(ChatMessage(m.role, m.content, m.name or None, calls, m.tool_call_id or None))
    prompt = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        tools=tools,
        template_kwargs=kwargs,
    )
    return tokenizer_pb2.TokenizeResponse(input_ids=prompt.input_ids, prompt_text=prompt.text)


def info_to_pb(info: TokenizerInfo) -> tokenizer_pb2.TokenizerInfoResponse:
    return tokenizer_pb2.TokenizerInfoResponse(
        model_name=info.model_name,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        context_length=info.context_length,
        think_tokens=info.think_tokens,
        tool_call_parser=info.tool_call_parser,
        reasoning_parser=info.reasoning_parser,
    )
