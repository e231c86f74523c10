"""gRPC channels and typed calls to the backend services (tokenizer, decode, prefill, detokenizer).

One ``grpc.aio`` channel per address, shared by every call. Each method returns ``io_struct`` values
and raises ``GatewayError`` (mapped from the backend's status code) on failure. Requests are built and
answers read in ``convert``; this module holds the generated stubs only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from pdserve.mem_cache.kv_events import KVEventBatch
from pdserve.rpc import tls
from pdserve.rpc.server import GRPC_OPTIONS
from pdserve.services.gateway.errors import from_rpc_error
from pdserve.services.gateway.io_struct import (
    ModelInfo,
    Prompt,
    SamplingParams,
    TokenizedPrompt,
    TokenPiece,
    WorkerLoad,
)
from pdserve.services.gateway.transport import convert

# Reconnect to a restarted worker within a second or two (gRPC's default backoff grows to 120 s).
_CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

Role = Literal["tokenizer", "decode", "prefill", "detokenizer"]


class BackendClients:
    """Channels (one per "host:port") and stubs, created on first use.

    Args:
        rpc_timeout: seconds allowed for request-path calls (tokenize, generate ack, abort).
        probe_timeout: seconds allowed for health, load and metrics probes.
    """

    def __init__(self, rpc_timeout: float = 30.0, probe_timeout: float = 2.0) -> None:
        self.rpc_timeout = rpc_timeout
        self.probe_timeout = probe_timeout
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, str], object] = {}

    def _stub(self, kind: str, address: str):
        key = (kind, address)
        stub = self._stubs.get(key)
        if stub is None:
            channel = self._channels.get(address)
            if channel is None:
                channel = tls.internal_channel(address, _CHANNEL_OPTIONS)
                self._channels[address] = channel
            stub = self._stubs[key] = convert.STUBS[kind](channel)
        return stub

    async def _call(self, method: Callable[..., Awaitable[Any]], request: Message, peer: str) -> Any:
        """``await method(request)`` within ``rpc_timeout``.

        Raises:
            GatewayError: mapped from the status code the call failed with (``from_rpc_error``,
                naming ``peer``).
        """
        try:
            return await method(request, timeout=self.rpc_timeout)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, peer) from e

    async def tokenize(self, address: str, prompt: Prompt, add_special_tokens: bool) -> TokenizedPrompt:
        """Token ids of a text or chat prompt (chat goes through the model's chat template)."""
        method = self._stub("tokenizer", address).Tokenize
        resp = await self._call(method, convert.tokenize_request(prompt, add_special_tokens), "tokenizer")
        return convert.tokenized_prompt_from_pb(resp)

    async def tokenize_batch(
        self, address: str, prompts: list[Prompt], add_special_tokens: bool
    ) -> list[TokenizedPrompt]:
        method = self._stub("tokenizer", address).TokenizeBatch
        request = convert.tokenize_batch_request(prompts, add_special_tokens)
        return convert.tokenized_prompts_from_pb(await self._call(method, request, "tokenizer"))

    async def detokenize(self, address: str, ids: list[int], skip_special_tokens: bool) -> str:
        method = self._stub("tokenizer", address).Detokenize
        resp = await self._call(method, convert.detokenize_request(ids, skip_special_tokens), "tokenizer")
        return resp.text

    async def token_pieces(self, address: str, ids: list[int]) -> list[TokenPiece]:
        method = self._stub("tokenizer", address).GetTokenPieces
        resp = await self._call(method, convert.token_pieces_request(ids), "tokenizer")
        return convert.token_pieces_from_pb(resp)

    async def model_info(self, address: str) -> ModelInfo:
        method = self._stub("tokenizer", address).GetInfo
        resp = await self._call(method, convert.tokenizer_info_request(), "tokenizer")
        return convert.model_info_from_pb(resp)

    async def generate(
        self,
        address: str,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        **routing: str | float | list[str],
    ) -> None:
        """Hand one tokenized request to a decode-scheduler (``DecodeScheduler.Generate``).

        ``routing``: prefill_address, fallback_prefill_addresses, output_address, gateway_address,
        deadline_unix_s, arrival_unix_s, and a migrated request's resumed_output_ids.
        """
        request = convert.tokenized_req_to_pb(rid, input_ids, sampling_params, **routing)
        await self._call(self._stub("decode", address).Generate, request, f"decode-scheduler {address}")

    async def abort(self, address: str, rid: str, reason: str) -> bool:
        """``DecodeScheduler.Abort``; True when the scheduler still held ``rid``."""
        method = self._stub("decode", address).Abort
        resp = await self._call(method, convert.abort_request(rid, reason), f"decode-scheduler {address}")
        return resp.found

    async def load_lora_adapter(
        self, role: Literal["decode", "prefill"], address: str, name: str, path: str
    ) -> None:
        """``LoadLoraAdapter`` on one scheduler (``lora_calls.load_adapter``)."""
        request = convert.load_lora_adapter_request(name, path)
        await self._call(self._stub(role, address).LoadLoraAdapter, request, f"{role}-scheduler {address}")

    async def unload_lora_adapter(self, role: Literal["decode", "prefill"], address: str, name: str) -> None:
        """``UnloadLoraAdapter`` on one scheduler (``lora_calls.unload_adapter``)."""
        request = convert.unload_lora_adapter_request(name)
        await self._call(self._stub(role, address).UnloadLoraAdapter, request, f"{role}-scheduler {address}")

    async def load(self, role: Literal["decode", "prefill"], address: str) -> WorkerLoad:
        """The scheduler's load, capacity and incarnation (``GetLoad``)."""
        resp = await self._stub(role, address).GetLoad(convert.load_request(), timeout=self.probe_timeout)
        return convert.worker_load_from_pb(resp)

    async def kv_events(
        self, role: Literal["decode", "prefill"], address: str, from_seq: int | None, incarnation: str
    ) -> AsyncIterator[tuple[str, KVEventBatch]]:
        """The scheduler's KV event batches as ``(incarnation, batch)`` (``SubscribeKVEvents``): a
        replay from ``from_seq`` of ``incarnation``, or a snapshot first; waits for the channel to be
        ready (the channel's reconnect backoff) instead of failing while the worker is down.

        Raises:
            grpc.aio.AioRpcError: the stream broke (the worker died, or cut this consumer off).
        """
        call = self._stub(role, address).SubscribeKVEvents(
            convert.kv_events_request(from_seq, incarnation), wait_for_ready=True
        )
        try:
            async for pb in call:
                yield convert.kv_event_batch_from_pb(pb)
        finally:
            call.cancel()

    async def metrics(self, role: Role, address: str) -> tuple[str, str, str]:
        """``(role, worker, prometheus text)`` of one scheduler or detokenizer (``GetMetrics``)."""
        resp = await self._stub(role, address).GetMetrics(
            convert.metrics_request(), timeout=self.probe_timeout
        )
        return convert.metrics_from_pb(resp, role, address)

    async def serving_status(self, address: str, service: str = "") -> bool | None:
        """``address``'s grpc.health.v1 answer for ``service`` ("" = the server as a whole): True for
        SERVING, False for another status or an error it answered with (NOT_FOUND: it does not serve
        ``service``), None when it did not answer within ``probe_timeout`` (down, hung, or
        unreachable)."""
        try:
            resp = await self._stub("health", address).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self.probe_timeout
            )
        except grpc.aio.AioRpcError as e:
            silent = e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
            return None if silent else False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
