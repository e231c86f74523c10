"""SSE chunks encoded from dicts by orjson are the JSON the OpenAI response models give."""

from __future__ import annotations

import json

import pytest

from pdserve.services.gateway.openai.protocol_responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobEntry,
    ChatLogprobs,
    CompletionChunk,
    CompletionLogprobs,
    CompletionStreamChoice,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    UsageInfo,
)
from pdserve.services.gateway.openai.stream_chunks import ChunkEncoder, chat_choice, completion_choice

USAGE = UsageInfo.of(12, 3, 8)
CALL = DeltaToolCall(index=0, id="call_1", type="function", function=DeltaFunction(name="f", arguments='{"'))


@pytest.mark.parametrize(
    ("fields", "usage"),
    [
        ({"text": " héllo ☃"}, None),
        ({"text": "", "finish_reason": "stop", "matched_stop": "\n\n"}, USAGE),
        ({"text": "x", "finish_reason": "length", "matched_stop": 2}, None),
        ({"text": "y", "logprobs": CompletionLogprobs(tokens=["y"], token_logprobs=[-0.25])}, None),
    ],
)
def test_completion_chunks_match_the_pydantic_model(fields, usage):
    encoder = ChunkEncoder("text_completion", "cmpl-abc", "SmolLM2")
    ours = json.loads(encoder.encode([completion_choice(3, **fields)], usage))
    model = CompletionChunk(
        id="cmpl-abc",
        created=encoder.created,
        model="SmolLM2",
        choices=[CompletionStreamChoice(index=3, **fields)],
        usage=usage,
    )
    assert ours == json.loads(model.model_dump_json())


@pytest.mark.parametrize(
    ("args", "delta", "extra"),
    [
        (("", "assistant"), DeltaMessage(role="assistant", content=""), {}),
        ((" the sea",), DeltaMessage(content=" the sea"), {}),
        ((None,), DeltaMessage(), {"finish_reason": "stop", "matched_stop": 2}),
        ((None,), DeltaMessage(reasoning_content="hm"), {"reasoning_content": "hm"}),
        ((None,), DeltaMessage(tool_calls=[CALL]), {"tool_calls": [CALL]}),
        (
            ("a",),
            DeltaMessage(content="a"),
            {"logprobs": ChatLogprobs(content=[ChatLogprobEntry(token="a", logprob=-1.5, bytes=[97])])},
        ),
    ],
)
def test_chat_chunks_match_the_pydantic_model(args, delta, extra):
    encoder = ChunkEncoder("chat.completion.chunk", "chatcmpl-abc", "SmolLM2")
    ours = json.loads(encoder.encode([chat_choice(1, *args, **extra)], USAGE))
    on_choice = {k: v for k, v in extra.items() if k not in ("reasoning_content", "tool_calls")}
    model = ChatCompletionChunk(
        id="chatcmpl-abc",
        created=encoder.created,
        model="SmolLM2",
        choices=[ChatChunkChoice(index=1, delta=delta, **on_choice)],
        usage=USAGE,
    )
    assert ours == json.loads(model.model_dump_json())
