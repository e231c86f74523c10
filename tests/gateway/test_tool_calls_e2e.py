"""Tool calls and reasoning end to end on SmolLM2, through the official ``openai`` client.

The session stacks run with no chat-parser flags, as ``make run`` does: SmolLM2's template does not
render tools, so the tokenizer shows them to the model in the hermes convention and the gateway
reads hermes calls. A forced call ("required" or a named function) is held by a grammar made from
the tools' schemas, so even a 135M model emits a valid call; its parsed arguments must validate
against the tool's schema. With "auto" the model calls a tool when an earlier turn showed it one.
The reasoning test runs on a second gateway with ``--reasoning-parser qwen3``.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.gateway.conftest import replica_of
from tests.gateway.schemas import SCHEMAS
from tests.reference import hf_tokenizer
from tests.stack import SERVED_MODEL, Stack

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, timeout=300)


def required_call(stack: Stack, **extra):
    """The one choice of a greedy QUESTION that must call a tool. One call: with parallel calls
    allowed, greedy SmolLM2 repeats the same call until max_tokens (a second <tool_call> by token
    ~45 of 96), and a cut call is content, not a call."""
    return (
        client(stack)
        .chat.completions.create(
            model=SERVED_MODEL,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            temperature=0,
            max_tokens=96,
            **({"parallel_tool_calls": False} | extra),
        )
        .choices[0]
    )


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


@pytest.mark.parametrize("which", ["colocated", "stack"])
def test_required_tool_call_validates_against_the_tool_schema(which, request) -> None:
    choice = required_call(request.getfixturevalue(which))
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    check_calls(choice.message.tool_calls)


def test_named_call_streams_arguments_that_concatenate_to_the_whole(colocated) -> None:
    kwargs = dict(
        model=SERVED_MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=96,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    whole = client(colocated).chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert [c.function.name for c in whole.message.tool_calls] == ["get_time"]
    check_calls(whole.message.tool_calls)
    pieces = [
        (chunk.choices[0].delta.tool_calls or [], chunk.choices[0].finish_reason)
        for chunk in client(colocated).chat.completions.create(stream=True, **kwargs)
        if chunk.choices
    ]
    deltas = [d for calls, _ in pieces for d in calls]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_time"
    assert {d.index for d in deltas} == {0}
    assert (
        "".join(d.function.arguments or "" for d in deltas) == whole.message.tool_calls[0].function.arguments
    )
    assert sum(bool(d.function.arguments) for d in deltas) > 1  # incremental, not in one piece
    assert pieces[-1][1] == "tool_calls"


def test_parallel_calls_off_gives_one_call_and_auto_may_answer_in_text(colocated) -> None:
    assert len(required_call(colocated, parallel_tool_calls=False).message.tool_calls) == 1
    auto = client(colocated).chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS,
        temperature=0, max_tokens=16,
    )  # fmt: skip
    message = auto.choices[0].message
    assert message.tool_calls == [] and message.content
    assert auto.choices[0].finish_reason in ("stop", "length")


def test_auto_calls_a_tool_after_a_turn_that_did(colocated) -> None:
    """One earlier turn with a call (rendered by the default tool rendering) and the same question
    about another city: greedy SmolLM2 calls get_weather for it, parsed with no flag, whole and
    streamed alike."""
    call = {
        "id": "c0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "What is the weather in London right now?"},
    ]
    kwargs = dict(model=SERVED_MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=64)
    whole = client(colocated).chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    check_calls(whole.message.tool_calls)
    assert [c.function.name for c in whole.message.tool_calls] == ["get_weather"]
    assert json.loads(whole.message.tool_calls[0].function.arguments)["city"] == "London"
    deltas = [
        d
        for chunk in client(colocated).chat.completions.create(stream=True, **kwargs)
        if chunk.choices
        for d in chunk.choices[0].delta.tool_calls or []
    ]
    assert (
        "".join(d.function.arguments or "" for d in deltas) == whole.message.tool_calls[0].function.arguments
    )


def test_second_turn_with_the_tool_result_renders_and_answers(colocated) -> None:
    first = required_call(colocated)
    call = first.message.tool_calls[0]
    turn = [
        *QUESTION,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius and sunny"},
    ]
    tokens = httpx.post(f"{colocated.base_url}/tokenize", json={"messages": turn}, timeout=60).json()[
        "tokens"
    ]
    assert "18 degrees celsius and sunny" in hf_tokenizer().decode(tokens)
    second = client(colocated).chat.completions.create(
        model=SERVED_MODEL, messages=turn, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=32
    )
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    assert second.choices[0].finish_reason in ("stop", "length")


FEW_SHOT = [
    {"role": "system", "content": "Think inside <think> and </think>, then answer in JSON."},
    {"role": "user", "content": "Describe a person."},
    {
        "role": "assistant",
        "content": '<think>A person has a name and an age.</think>{"name": "Ana", "age": 30}',
    },
    {"role": "user", "content": "Describe a person."},
    {"role": "assistant", "content": "<think>"},
]


async def test_reasoning_then_a_grammar_for_the_answer(colocated) -> None:
    """The request continues an open <think>: the reasoning is free text, the answer after
    </think> is held to the schema; the stream splits the same way."""
    schema = SCHEMAS[0][1]
    kwargs = dict(
        model=SERVED_MODEL, messages=FEW_SHOT, temperature=0, max_tokens=96,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )  # fmt: skip
    async with replica_of(colocated, "--reasoning-parser", "qwen3") as replica:
        reasoner = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{replica.http_port}/v1", api_key="none", max_retries=0, timeout=300
        )
        whole = (await reasoner.chat.completions.create(**kwargs)).choices[0]
        chunks = [
            c.choices[0].delta
            async for c in await reasoner.chat.completions.create(stream=True, **kwargs)
            if c.choices
        ]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning
    jsonschema.validate(json.loads(whole.message.content), schema)
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in chunks) == reasoning
    assert "".join(d.content or "" for d in chunks) == whole.message.content
