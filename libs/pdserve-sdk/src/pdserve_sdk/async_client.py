"""The asyncio client: ``AsyncClient`` and its ``AsyncStream`` of deltas (on ``grpc.aio``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Unpack

import grpc.aio

from pdserve_sdk import _wire
from pdserve_sdk._base import ClientBase
from pdserve_sdk.errors import translated_errors
from pdserve_sdk.requests import ChatKwargs, RequestKwargs, chat_request, embed_request, generate_request
from pdserve_sdk.results import (
    Delta,
    EmbedResult,
    GenerateResult,
    ModelCard,
    collect,
    delta_from_pb,
    embed_result_from_pb,
)


class AsyncStream:
    """Async iterator over the ``Delta`` pieces of one ``Generate`` call.

    Leaving it early cancels the call, and the server aborts the request: ``await aclose()``, the end
    of an ``async with`` block, or dropping the last reference (``break`` out of ``async for``).
    Iterating raises a ``PdServeError`` subclass when the call fails.
    """

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self._closed = False
        self.rid = ""

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Delta:
        if self._closed:
            raise StopAsyncIteration
        with translated_errors():
            response = await self._call.read()
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        delta = delta_from_pb(response)
        self.rid = self.rid or delta.rid
        return delta

    async def aclose(self) -> None:
        """Cancel the call if it is still running; iteration then stops."""
        self._closed = True
        self._call.cancel()

    def __del__(self) -> None:
        # grpc.aio's call sits in reference cycles with its tasks, so its own cancel-on-collection
        # would wait for the cycle collector; this object is not in one and goes at once.
        self._call.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncClient(ClientBase):
    """asyncio client of the pdserve public gRPC API; create it inside a running event loop. See
    ``ClientBase`` for the arguments; ``async with`` or ``await close()`` closes the channel.

    Every call takes ``timeout`` (seconds, the gRPC deadline) and raises ``PdServeError`` subclasses.
    """

    grpc_module = grpc.aio

    async def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        **kwargs: Unpack[RequestKwargs],
    ) -> GenerateResult:
        """Generate from a text ``prompt`` or token ``input_ids`` and wait for the whole result."""
        async with self.stream(prompt, input_ids=input_ids, timeout=timeout, **kwargs) as deltas:
            return collect([delta async for delta in deltas])

    def stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        **kwargs: Unpack[RequestKwargs],
    ) -> AsyncStream:
        """Like ``generate``, but yield the output as it is produced (``async for``)."""
        request = generate_request(prompt, input_ids, self.model, kwargs)
        return AsyncStream(self._stubs.generate(request, **self._call_kwargs(timeout)))

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        timeout: float | None = None,
        **kwargs: Unpack[ChatKwargs],
    ) -> GenerateResult:
        """Answer chat ``messages`` rendered with the model's template (their shape: ``chat_request``)."""
        async with self.chat_stream(messages, timeout=timeout, **kwargs) as deltas:
            return collect([delta async for delta in deltas])

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        timeout: float | None = None,
        **kwargs: Unpack[ChatKwargs],
    ) -> AsyncStream:
        """Like ``chat``, but yield the answer as it is produced (``async for``)."""
        request = chat_request(messages, self.model, kwargs)
        return AsyncStream(self._stubs.generate(request, **self._call_kwargs(timeout)))

    async def embed(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        dimensions: int | None = None,
        model: str | None = None,
        rid: str = "",
        timeout: float | None = None,
    ) -> EmbedResult:
        """Embed a text, a list of texts or a list of token-id lists (as ``/v1/embeddings``;
        ``dimensions``: the first values only, L2-normalised again)."""
        request = embed_request(inputs, self.model, dimensions, model, rid)
        with translated_errors():
            response = await self._stubs.embed(request, **self._call_kwargs(timeout))
        return embed_result_from_pb(response)

    async def models(self, *, timeout: float | None = None) -> list[ModelCard]:
        """The models this server serves: the base model's names, then the LoRA adapters loaded
        (``parent`` naming their base model)."""
        with translated_errors():
            response = await self._stubs.list_models(_wire.ListModelsRequest(), **self._call_kwargs(timeout))
        return [ModelCard(m.id, m.context_length, m.parent) for m in response.models]

    async def abort(self, rid: str, *, timeout: float | None = None) -> bool:
        """Abort request ``rid`` (running on any client); ``False`` if the server does not know it."""
        with translated_errors():
            response = await self._stubs.abort(
                _wire.PublicAbortRequest(rid=rid), **self._call_kwargs(timeout)
            )
        return bool(response.found)

    async def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None) -> str:
        """Load the PEFT adapter at ``path`` (on the workers' filesystem) as model ``name`` on every
        worker (as ``POST /v1/load_lora_adapter``); the server's confirmation line."""
        request = _wire.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        with translated_errors():
            return (await self._stubs.load_lora_adapter(request, **self._call_kwargs(timeout))).message

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> str:
        """Unload adapter ``name`` from every worker (as ``POST /v1/unload_lora_adapter``)."""
        request = _wire.UnloadLoraAdapterRequest(lora_name=name)
        with translated_errors():
            return (await self._stubs.unload_lora_adapter(request, **self._call_kwargs(timeout))).message

    async def health(self, service: str = _wire.PDSERVE_SERVICE, *, timeout: float | None = None) -> str:
        """``grpc.health.v1`` status of ``service`` ("" for the whole server).

        Returns ``"SERVING"``, ``"NOT_SERVING"`` or ``"UNKNOWN"``; raises ``NotFoundError`` for a service
        the server does not know.
        """
        request = _wire.HealthCheckRequest(service=service)
        with translated_errors():
            response = await self._stubs.health_check(request, **self._call_kwargs(timeout))
        return _wire.SERVING_STATUSES[response.status]

    async def close(self) -> None:
        """Close the channel, cancelling calls still running on it."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
