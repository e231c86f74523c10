"""Status-code mapping, gRPC's retry policy and call metadata, against a scripted real gRPC server."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from pdserve_sdk import (
    AsyncClient,
    AuthenticationError,
    Client,
    DeadlineExceededError,
    InvalidRequestError,
    ModelCard,
    NotFoundError,
    PdServeError,
    RateLimitError,
    RetryPolicy,
    ServiceUnavailableError,
    Usage,
)

from tests.stack import free_port_block

NO_RETRY = RetryPolicy(max_retries=0)
FAST_RETRY = RetryPolicy(max_retries=3, initial_backoff=0.01, max_backoff=0.02)

EXPECTED = {
    "INVALID_ARGUMENT": InvalidRequestError,
    "OUT_OF_RANGE": InvalidRequestError,
    "UNAUTHENTICATED": AuthenticationError,
    "PERMISSION_DENIED": AuthenticationError,
    "NOT_FOUND": NotFoundError,
    "RESOURCE_EXHAUSTED": RateLimitError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "UNAVAILABLE": ServiceUnavailableError,
    "INTERNAL": PdServeError,
}


@pytest.mark.parametrize("code", EXPECTED)
def test_status_code_maps_to_typed_error(scripted_server, code):
    address, _ = scripted_server
    with Client(address, retry=NO_RETRY) as client, pytest.raises(PdServeError) as info:
        client.generate("x", rid=f"fail:{code}")
    assert type(info.value) is EXPECTED[code]
    assert info.value.code is grpc.StatusCode[code]
    assert info.value.message == f"scripted {code}"


async def test_async_client_maps_errors_too(scripted_server):
    address, _ = scripted_server
    async with AsyncClient(address, retry=NO_RETRY) as client:
        with pytest.raises(RateLimitError, match="scripted RESOURCE_EXHAUSTED"):
            await client.generate("x", rid="fail:RESOURCE_EXHAUSTED")


def test_result_collects_pieces_and_usage(scripted_server):
    address, _ = scripted_server
    with Client(address) as client:
        result = client.generate("x", rid="plain:collect")
        assert (result.rid, result.text, result.token_ids, result.finish_reason) == (
            "plain:collect",
            "ab",
            [1, 2],
            "length",
        )
        assert result.usage == Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=0)
        assert client.models() == [ModelCard("scripted", 7)]


def test_unavailable_before_acceptance_is_retried(scripted_server):
    address, servicer = scripted_server
    with Client(address, retry=FAST_RETRY) as client:
        assert client.generate("x", rid="flaky:3:sync").text == "ab"
    assert servicer.attempts["flaky:3:sync"] == 4


async def test_async_unavailable_before_acceptance_is_retried(scripted_server):
    address, servicer = scripted_server
    async with AsyncClient(address, retry=FAST_RETRY) as client:
        assert (await client.generate("x", rid="flaky:2:async")).text == "ab"
    assert servicer.attempts["flaky:2:async"] == 3


def test_retries_stop_at_max_retries(scripted_server):
    address, servicer = scripted_server
    retry = RetryPolicy(max_retries=1, initial_backoff=0.01, max_backoff=0.01)
    with Client(address, retry=retry) as client, pytest.raises(ServiceUnavailableError, match="not yet"):
        client.generate("x", rid="flaky:3:capped")
    assert servicer.attempts["flaky:3:capped"] == 2


def test_accepted_stream_is_not_retried(scripted_server):
    address, servicer = scripted_server
    with Client(address, retry=FAST_RETRY) as client:
        stream = client.stream("x", rid="midstream:once")
        assert next(stream).text == "a"
        with pytest.raises(ServiceUnavailableError, match="backend lost"):
            next(stream)
    assert servicer.attempts["midstream:once"] == 1


def test_api_key_travels_as_bearer_metadata(scripted_server, monkeypatch):
    address, servicer = scripted_server
    with Client(address, api_key="secret") as client:
        client.generate("x", rid="plain:key")
    assert servicer.metadata[-1]["authorization"] == "Bearer secret"
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    monkeypatch.setenv("PDSERVE_ADDRESS", address)
    with Client() as client:
        client.generate("x", rid="plain:env-key")
    assert servicer.metadata[-1]["authorization"] == "Bearer from-env"
    assert servicer.metadata[-1]["user-agent"].startswith("pdserve-sdk/0.1.0")


def test_leaving_a_stream_cancels_the_call(scripted_server):
    address, servicer = scripted_server
    with Client(address) as client:
        for i, _delta in enumerate(client.stream("x", rid="endless:break")):
            if i == 1:
                break
        assert servicer.ended["endless:break"].wait(2.0)
        stream = client.stream("x", rid="endless:close")
        with stream:
            next(stream)
        assert servicer.ended["endless:close"].wait(2.0)
        assert list(stream) == []


async def test_leaving_an_async_stream_cancels_the_call(scripted_server):
    address, servicer = scripted_server
    async with AsyncClient(address) as client:
        async for _delta in client.stream("x", rid="endless:async-break"):
            break
        assert await asyncio.to_thread(servicer.ended["endless:async-break"].wait, 2.0)
        stream = client.stream("x", rid="endless:aclose")
        await anext(stream)
        await stream.aclose()
        assert await asyncio.to_thread(servicer.ended["endless:aclose"].wait, 2.0)
        assert [d async for d in stream] == []


def _unused_address() -> str:
    return f"127.0.0.1:{free_port_block(1)}"


def _seconds_until_unavailable(address: str, retry: RetryPolicy) -> float:
    with Client(address, retry=retry) as client:
        start = time.monotonic()
        with pytest.raises(ServiceUnavailableError, match="Connection refused|failed to connect"):
            client.generate("x")
        return time.monotonic() - start


def test_nothing_listening_retries_with_backoff_then_raises_unavailable():
    address = _unused_address()
    retry = RetryPolicy(max_retries=3, initial_backoff=0.3, max_backoff=0.3, backoff_multiplier=1)
    with_retries = _seconds_until_unavailable(address, retry)
    without = _seconds_until_unavailable(address, NO_RETRY)
    # three waits of 0.3 s each with gRPC's +-20 % jitter
    assert with_retries >= 3 * 0.3 * 0.8 > without
