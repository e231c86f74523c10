"""Leaving a stream, deadlines, aborts and server-side errors: the SDK against the launched PD stack."""

from __future__ import annotations

import asyncio
import time

import grpc
import openai
import pytest
from pdserve_sdk import AsyncClient, Client, DeadlineExceededError, InvalidRequestError, NotFoundError

from tests.stack import SERVED_MODEL, Stack

LONG = {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True}
PROMPT = "Count from one to one thousand:"


def running(stack: Stack) -> float:
    return sum(stack.scheduler_values("pdserve:num_running_reqs").values())


def wait_not_running(stack: Stack, within: float) -> float:
    """Seconds until no scheduler reports a running request; fails after ``within`` seconds."""
    start = time.monotonic()
    while running(stack):
        assert time.monotonic() - start < within, f"requests still running after {within} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_breaking_out_of_a_stream_aborts_the_request(stack):
    with Client(stack.grpc_address) as client:
        for i, _delta in enumerate(client.stream(PROMPT, **LONG)):
            if i == 1:
                assert running(stack) == 1
                break
        wait_not_running(stack, within=2.0)
        stream = client.stream(PROMPT, **LONG)
        with stream:
            next(stream)
        wait_not_running(stack, within=2.0)
        assert list(stream) == []


async def test_async_break_and_aclose_abort_the_request(stack):
    async with AsyncClient(stack.grpc_address) as client:
        async for _delta in client.stream(PROMPT, **LONG):
            break
        await asyncio.to_thread(wait_not_running, stack, 2.0)
        stream = client.stream(PROMPT, **LONG)
        await anext(stream)
        await stream.aclose()
        await asyncio.to_thread(wait_not_running, stack, 2.0)


def test_timeout_raises_deadline_exceeded_and_frees_the_server(stack):
    with Client(stack.grpc_address) as client:
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError) as info:
            client.generate(PROMPT, timeout=0.05, **LONG)
        assert time.monotonic() - start < 1.0
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        wait_not_running(stack, within=2.0)
        # the default timeout of the client applies the same way
        with Client(stack.grpc_address, timeout=0.05) as short, pytest.raises(DeadlineExceededError):
            short.generate(PROMPT, **LONG)
        wait_not_running(stack, within=2.0)


def test_abort_by_rid_ends_the_stream(stack):
    with Client(stack.grpc_address) as client:
        stream = client.stream(PROMPT, rid="sdk-abort-me", **LONG)
        first = next(stream)
        assert client.abort("sdk-abort-me") is True
        rest = list(stream)
        assert rest and rest[-1].finish_reason == "abort"
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) < LONG["max_new_tokens"]
        assert client.abort("sdk-abort-me") is False


def test_invalid_parameter_raises_with_the_servers_message(stack):
    with Client(stack.grpc_address) as client:
        with pytest.raises(InvalidRequestError) as info:
            client.generate("Hi", top_p=1.5)
        assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "top_p" in info.value.message and "less than or equal to 1" in info.value.message
        with pytest.raises(NotFoundError, match="no-such-model"):
            client.generate("Hi", model="no-such-model", max_new_tokens=2)


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("messages", "kwargs", "needle"),
    [
        ([{"role": "x", "content": "hi"}], {}, "messages.0.role: Input should be 'system'"),
        (HI, {"n": 0}, "sampling_params.n: Input should be greater than or equal to 1"),
        (HI, {"top_logprobs_num": 2}, "'top_logprobs_num' requires 'return_logprob' to be true"),
    ],
    ids=["unknown-role", "n-zero", "top-logprobs-without-logprob"],
)
def test_chat_is_refused_like_http_chat(stack, messages, kwargs, needle):
    with Client(stack.grpc_address) as client, pytest.raises(InvalidRequestError) as info:
        client.chat(messages, max_new_tokens=2, **kwargs)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.message


def test_chat_tools_are_shown_to_the_template_as_http_does_with_tool_choice_none(stack):
    """The gRPC API never parses tool calls, so its tools mean HTTP's ``tool_choice='none'``."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    http = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none").chat.completions.create(
        model=SERVED_MODEL, messages=HI, tools=tools, tool_choice="none", temperature=0, max_tokens=4
    )
    with Client(stack.grpc_address) as client:
        result = client.chat(HI, tools=tools, temperature=0, max_new_tokens=4)
    assert result.usage.prompt_tokens == http.usage.prompt_tokens
    assert result.text == http.choices[0].message.content
