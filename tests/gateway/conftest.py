"""Gateways for the tests of this folder.

``local_gateway``: a real gateway (uvicorn + grpc.aio, in this test process) with a real tokenizer
service and no schedulers. The decode and detokenizer addresses point at ports nothing listens on, so
every request that passes validation ends with 503 UNAVAILABLE: what the gateway must do before any
scheduler is involved can be checked without one.

``replica_of``: a second gateway (in this test process) on the workers of a launched stack, with flags
of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest_asyncio

from pdserve.rpc.server import wait_for_health
from pdserve.services.gateway.main import Gateway, parse_args
from pdserve.services.tokenizer.main import build_parser, start_server
from tests.stack import Stack, free_port_block

API_KEY = "sk-gateway-test"
MAX_REQUEST_BYTES = 64 * 1024
BODY_TIMEOUT_S = 2.0


@dataclass
class LocalGateway:
    gateway: Gateway
    tokenizer_address: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    @property
    def grpc_address(self) -> str:
        return self.gateway.grpc_address


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def local_gateway():
    tokenizer = await start_server(build_parser().parse_args(["--port", "0"]))
    assert await wait_for_health(tokenizer.address, timeout=30)
    args = parse_args(
        [
            "--port", "0", "--grpc-port", "0",
            "--tokenizer-addresses", tokenizer.address,
            "--decode-addresses", f"127.0.0.1:{free_port_block(1)}",
            "--detokenizer-addresses", f"127.0.0.1:{free_port_block(1)}",
            "--api-key", API_KEY,
            "--max-request-bytes", str(MAX_REQUEST_BYTES),
            "--request-body-timeout", str(BODY_TIMEOUT_S),
            "--log-level", "warning",
        ]
    )  # fmt: skip
    gateway = Gateway(args)
    await gateway.start()
    yield LocalGateway(gateway, tokenizer.address)
    await gateway.stop()
    await tokenizer.stop(0)


@contextlib.asynccontextmanager
async def replica_of(stack: Stack, *flags: str) -> AsyncIterator[Gateway]:
    """A gateway on ``stack``'s workers with ``flags`` (free ports), stopped on exit."""
    roles = httpx.get(f"{stack.base_url}/health", timeout=10).json()["roles"]
    addresses = [f"--{role}-addresses={','.join(addrs)}" for role, addrs in roles.items()]
    args = parse_args([*addresses, "--port", "0", "--grpc-port", "0", "--log-level", "warning", *flags])
    replica = Gateway(args)
    await replica.start()
    try:
        yield replica
    finally:
        await replica.stop()
