"""HTTP requests that arrive slowly or never end, against the real gateway of ``local_gateway``
(``--request-body-timeout`` of ``BODY_TIMEOUT_S``), over raw sockets: a body that stops arriving gets
a 408 in OpenAI's error shape and its connection is closed; one that arrives in time is served; a
request head that grows past ``MAX_INCOMPLETE_HEAD_BYTES`` is refused; and (on the colocated stack) a
response that outlasts the body limit after its body arrived is not cut."""

from __future__ import annotations

import asyncio
import json
import time

import h11
import httpx

from pdserve.services.gateway.main import MAX_INCOMPLETE_HEAD_BYTES
from tests.gateway.conftest import API_KEY, BODY_TIMEOUT_S, replica_of
from tests.reference import hf_tokenizer


class RawClient:
    """One HTTP/1.1 connection whose request body is sent piece by piece (h11 frames and parses)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send_head(self, path: str, content_length: int) -> None:
        headers = [
            ("Host", "127.0.0.1"),
            ("Authorization", f"Bearer {API_KEY}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(content_length)),
        ]
        await self._write(h11.Request(method="POST", target=path, headers=headers))

    async def send_body(self, piece: bytes) -> None:
        await self._write(h11.Data(data=piece))

    async def end_body(self) -> None:
        await self._write(h11.EndOfMessage())

    async def response(self, timeout: float) -> tuple[h11.Response, bytes]:
        """The response (its head and body), read within ``timeout`` seconds."""
        head, body = None, b""
        async with asyncio.timeout(timeout):
            while True:
                event = self.h11.next_event()
                if event is h11.NEED_DATA:
                    self.h11.receive_data(await self.reader.read(65536))
                elif isinstance(event, h11.Response):
                    head = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    return head, body

    async def closed_by_server(self, timeout: float) -> bool:
        """Whether the server closes the connection within ``timeout`` seconds."""
        async with asyncio.timeout(timeout):
            return await self.reader.read() == b""

    async def _write(self, event: h11.Event) -> None:
        self.writer.write(self.h11.send(event))
        await self.writer.drain()

    def close(self) -> None:
        self.writer.close()


async def test_a_body_that_stops_arriving_gets_408_and_the_connection_is_closed(local_gateway) -> None:
    client = await RawClient.connect(local_gateway.gateway.http_port)
    try:
        start = time.monotonic()
        await client.send_head("/tokenize", content_length=1000)
        await client.send_body(b'{"prom')
        head, body = await client.response(timeout=BODY_TIMEOUT_S + 10)
        waited = time.monotonic() - start
        assert head.status_code == 408
        assert (b"connection", b"close") in head.headers
        assert json.loads(body) == {
            "error": {
                "message": f"the request body did not arrive in full within {BODY_TIMEOUT_S:g} seconds",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
        assert BODY_TIMEOUT_S <= waited < BODY_TIMEOUT_S + 5
        assert await client.closed_by_server(timeout=5)
    finally:
        client.close()


async def test_a_slow_body_that_arrives_in_time_is_served(local_gateway) -> None:
    """Four pieces over ~1.5 s (under the 2 s limit), then a second request on the same connection
    more than the limit after the first one began: each request has its own deadline."""
    body = json.dumps({"prompt": "The capital of France is"}).encode()
    pieces = [body[i : i + 8] for i in range(0, len(body), 8)]
    expected = hf_tokenizer()("The capital of France is")["input_ids"]
    client = await RawClient.connect(local_gateway.gateway.http_port)
    try:
        for _ in range(2):
            await client.send_head("/tokenize", content_length=len(body))
            for piece in pieces:
                await asyncio.sleep(1.5 / len(pieces))
                await client.send_body(piece)
            await client.end_body()
            head, answer = await client.response(timeout=10)
            assert head.status_code == 200, answer
            assert json.loads(answer)["tokens"] == expected
            client.h11.start_next_cycle()
    finally:
        client.close()


async def test_a_request_head_that_grows_past_the_bound_is_refused(local_gateway) -> None:
    """A header line that never ends is not buffered past the bound: uvicorn answers 400 (its own
    plain-text answer to a request it cannot parse) and closes the connection. (Sent in 8 KiB pieces
    that stop once past the bound: data the server never read would turn its close into a reset.)"""
    reader, writer = await asyncio.open_connection("127.0.0.1", local_gateway.gateway.http_port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        for _ in range(MAX_INCOMPLETE_HEAD_BYTES // 8192 + 1):
            writer.write(b"a" * 8192)
            await writer.drain()
            await asyncio.sleep(0.02)
        async with asyncio.timeout(10):
            answer = await reader.read()  # until the server closes
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    finally:
        writer.close()


async def test_responses_that_outlast_the_limit_after_the_body_are_not_cut(colocated) -> None:
    """The limit is on the body alone: a stream and a whole response that take longer than it, once
    the body is in, end normally (both wait on ``receive`` for a disconnect while they run)."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Count to a hundred."}],
        "max_tokens": 48,
        "ignore_eos": True,
    }
    async with (
        replica_of(colocated, "--request-body-timeout", "0.2") as replica,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{replica.http_port}", timeout=120) as http,
    ):
        start = time.monotonic()
        whole = await http.post("/v1/chat/completions", json=body)
        assert time.monotonic() - start > 0.2
        assert whole.status_code == 200, whole.text
        assert whole.json()["usage"]["completion_tokens"] == 48
        start = time.monotonic()
        async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert time.monotonic() - start > 0.2
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
