"""The synchronous client: ``Client`` and its ``Stream`` of deltas."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Unpack

import grpc

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


class Stream:
    """Iterator over the ``Delta`` pieces of one ``Generate`` call.

    Leaving it early cancels the call, and the server aborts the request: ``close()``, the end of a
    ``with`` block, or dropping the last reference (e.g. ``break`` out of ``for d in client.stream(...)``).
    Iterating raises a ``PdServeError`` subclass when the call fails.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._closed = False
        self.rid = ""

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Delta:
        if self._closed:
            raise StopIteration
        with translated_errors():
            delta = delta_from_pb(next(self._call))
        self.rid = self.rid or delta.rid
        return delta

    def close(self) -> None:
        """Cancel the call if it is still running; iteration then stops."""
        self._closed = True
        self._call.cancel()

    def __del__(self) -> None:
        self._call.cancel()  # a no-op once the call has ended

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client(ClientBase):
    """Blocking client of the pdserve public gRPC API (``pdserve.v1.PdServe``); see ``ClientBase`` for the
    arguments. Use as a context manager, or call ``close()``, to close the channel.

    Every call takes ``timeout`` (seconds, the gRPC deadline) and raises ``PdServeError`` subclasses.
    """

    grpc_module = grpc

    def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        **kwargs: Unpack[RequestKwargs],
    ) -> GenerateResult:
        """Generate from a text ``prompt`` or token ``input_ids`` and wait for the whole result."""
        with self.stream(prompt, input_ids=input_ids, timeout=timeout, **kwargs) as deltas:
            return collect(deltas)

    def stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        **kwargs: Unpack[RequestKwargs],
    ) -> Stream:
        """Like ``generate``, but yield the output as it is produced."""
        request = generate_request(prompt, input_ids, self.model, kwargs)
        return Stream(self._stubs.generate(request, **self._call_kwargs(timeout)))

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        timeout: float | None = None,
        **kwargs: Unpack[ChatKwargs],
    ) -> GenerateResult:
        """Answer chat ``messages`` rendered with the model's template (their shape: ``chat_request``)."""
        with self.chat_stream(messages, timeout=timeout, **kwargs) as deltas:
            return collect(deltas)

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        timeout: float | None = None,
        **kwargs: Unpack[ChatKwargs],
    ) -> Stream:
        """Like ``chat``, but yield the answer as it is produced."""
        request = chat_request(messages, self.model, kwargs)
        return Stream(self._stubs.generate(request, **self._call_kwargs(timeout)))

    def embed(
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
            response = self._stubs.embed(request, **self._call_kwargs(timeout))
        return embed_result_from_pb(response)

    def models(self, *, timeout: float | None = None) -> list[ModelCard]:
        """The models this server serves: the base model's names, then the LoRA adapters loaded
        (``parent`` naming their base model)."""
        with translated_errors():
            response = self._stubs.list_models(_wire.ListModelsRequest(), **self._call_kwargs(timeout))
        return [ModelCard(m.id, m.context_length, m.parent) for m in response.models]

    def abort(self, rid: str, *, timeout: float | None = None) -> bool:
        """Abort request ``rid`` (running on any client); ``False`` if the server does not know it."""
        with translated_errors():
            response = self._stubs.abort(_wire.PublicAbortRequest(rid=rid), **self._call_kwargs(timeout))
        return bool(response.found)

    def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None) -> str:
        """Load the PEFT adapter at ``path`` (on the workers' filesystem) as model ``name`` on every
        worker (as ``POST /v1/load_lora_adapter``); the server's confirmation line."""
        request = _wire.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        with translated_errors():
            return self._stubs.load_lora_adapter(request, **self._call_kwargs(timeout)).message

    def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> str:
        """Unload adapter ``name`` from every worker (as ``POST /v1/unload_lora_adapter``)."""
        request = _wire.UnloadLoraAdapterRequest(lora_name=name)
        with translated_errors():
            return self._stubs.unload_lora_adapter(request, **self._call_kwargs(timeout)).message

    def health(self, service: str = _wire.PDSERVE_SERVICE, *, timeout: float | None = None) -> str:
        """``grpc.health.v1`` status of ``service`` ("" for the whole server).

        Returns ``"SERVING"``, ``"NOT_SERVING"`` or ``"UNKNOWN"``; raises ``NotFoundError`` for a service
        the server does not know.
        """
        with translated_errors():
            response = self._stubs.health_check(
                _wire.HealthCheckRequest(service=service), **self._call_kwargs(timeout)
            )
        return _wire.SERVING_STATUSES[response.status]

    def close(self) -> None:
        """Close the channel, cancelling calls still running on it."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
