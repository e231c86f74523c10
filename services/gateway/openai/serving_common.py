"""What every HTTP serving module needs: the model check, the request id, disconnect watching, SSE."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse

from pdserve.services.common.chat_parser_args import REASONING_PARSERS
from pdserve.services.gateway.auth import http_caller
from pdserve.services.gateway.errors import GatewayError, generation_failed
from pdserve.services.gateway.io_struct import ChoiceDelta, GenerateReqInput, TokenLogprob
from pdserve.services.gateway.openai.reasoning_parser import ReasoningParser
from pdserve.services.gateway.openai.tool_parsers import TOOL_PARSERS, ToolParser
from pdserve.services.gateway.requests.manager import RequestManager
from pdserve.services.gateway.requests.state import RequestHandle

REQUEST_ID_HEADER = "X-Request-Id"

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChatParsers:
    """How chat outputs are read back. ``tools``: the tool-call format (None: not recognised, so
    ``tool_choice`` "auto" cannot be served); ``reasoning``: the reasoning convention (None: none);
    ``think_tokens``: the vocabulary has ``<think>`` tokens."""

    tools: ToolParser | None
    reasoning: ReasoningParser | None
    think_tokens: bool


class ServingContext:
    """What the serving modules share: the manager, the served model names and the chat output
    parsers that ``--tool-call-parser`` and ``--reasoning-parser`` set (None: the model's own, as
    its chat template implies: ``chat_parsers``).

    ``model_names``: every id a client may send (``--served-model-name``, aliases included); the
    first, ``served_model_name``, is the one responses report (``response_model``). ``lora_names``:
    the LoRA adapters served (``--lora-modules``), which a request names as its model.
    """

    def __init__(
        self,
        manager: RequestManager,
        model_names: str | list[str],
        tool_parser: ToolParser | None = None,
        reasoning_parser: ReasoningParser | None = None,
        lora_names: list[str] | None = None,
    ) -> None:
        self.manager = manager
        self.model_names = [model_names] if isinstance(model_names, str) else list(model_names)
        self.lora_names = list(lora_names or [])
        self.served_model_name = self.model_names[0]
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser

    async def chat_parsers(self) -> ChatParsers:
        """The flags' parsers, else those the tokenizer service reads from the model's chat template
        (``pdserve.tokenization.chat_formats``).

        Raises:
            GatewayError: 503 while no tokenizer answers.
        """
        info = await self.manager.model_info()
        tools = self.tool_parser
        if tools is None and info.tool_call_parser in TOOL_PARSERS:
            tools = TOOL_PARSERS[info.tool_call_parser]()
        reasoning = self.reasoning_parser
        if reasoning is None and info.reasoning_parser in REASONING_PARSERS:
            reasoning = ReasoningParser(info.reasoning_parser)
        return ChatParsers(tools, reasoning, info.think_tokens)

    def listed_models(self) -> list[tuple[str, str | None]]:
        """What /v1/models and the gRPC API's ListModels list, in order: ``(id, parent)`` of every
        served name of the base model (parent None), then of every LoRA adapter (its parent the base
        model's ``served_model_name``, as vLLM's ``parent``)."""
        base = [(name, None) for name in self.model_names]
        return base + [(name, self.served_model_name) for name in self.lora_names]

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response reports: the LoRA adapter the request named (vLLM does the
        same), else ``served_model_name``."""
        return model if model in self.lora_names else self.served_model_name

    def check_model(self, model: str | None, required: bool = True) -> str:
        """The LoRA adapter ``model`` names (``""``: the base model, or ``model`` absent where optional).

        Raises:
            GatewayError: 404 ``model_not_found`` unless ``model`` is a served name or adapter.
        """
        if (model is None and not required) or model in self.model_names:
            return ""
        if model in self.lora_names:
            return model
        served = ", ".join(self.model_names + self.lora_names)
        raise GatewayError(
            404,
            f"The model '{model}' does not exist (served: '{served}')",
            param="model",
            code="model_not_found",
        )


def log_unknown_fields(rid: str, fields: list[str]) -> None:
    """Log the request fields this server ignored (vLLM's behaviour: accepted, not applied)."""
    if fields:
        logger.info("request %s: ignoring unknown fields %s", rid, ", ".join(fields[:50]))


def request_id(request: Request) -> str:
    """The rid of this HTTP request (``X-Request-Id`` or generated; set by ``RequestIdMiddleware``)."""
    return request.state.rid


def new_rid() -> str:
    return uuid.uuid4().hex


async def submit(request: Request, manager: RequestManager, obj: GenerateReqInput) -> RequestHandle:
    """``manager.submit(obj)`` (owned by the request's API key), cancelled if the HTTP client goes away
    first: sending a request's sub-requests takes a while for a batch, and every one already sent is
    then aborted.

    Raises:
        GatewayError: what ``submit`` raises; 499 when the client disconnected.
    """
    submitting = asyncio.ensure_future(manager.submit(obj, owner=http_caller(request)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((submitting, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not submitting.done():
            submitting.cancel()  # submit closes the handle: choices sent so far are aborted
    try:
        return await submitting
    except asyncio.CancelledError:
        raise GatewayError(499, f"request {obj.rid}: client disconnected") from None


async def _disconnected(request: Request) -> None:
    """Returns once the ASGI ``receive`` channel yields ``http.disconnect``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def watch_disconnect(request: Request, handle: RequestHandle) -> asyncio.Task:
    """Close ``handle`` (aborting its running choices) as soon as the HTTP client goes away.

    Listens on the ASGI ``receive`` channel, which yields ``http.disconnect`` when the connection
    drops (or once the response is complete, when closing is a no-op). Cancel the task when done.
    """

    async def watch() -> None:
        await _disconnected(request)
        handle.close("client disconnected")

    return asyncio.get_running_loop().create_task(watch())


@dataclass(slots=True)
class ChoiceResult:
    """A whole choice, accumulated from its ``ChoiceDelta`` pieces."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    embedding: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, delta: ChoiceDelta) -> None:
        """Append ``delta``; raises ``GatewayError`` 500 when the runtime failed the choice."""
        if delta.finish_reason == "error":
            raise generation_failed(delta.error, delta.retryable)
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.prompt_logprobs += delta.prompt_logprobs
        self.embedding += delta.embedding
        self.completion_tokens = max(delta.completion_tokens, len(self.token_ids))
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.matched_stop = delta.matched_stop


async def gather(handle: RequestHandle) -> list[ChoiceResult]:
    """Every choice of ``handle``, whole (``ChoiceResult.add``'s ``GatewayError`` on a failed one)."""
    results = [ChoiceResult(state.index) for state in handle.states]
    async with handle:
        async for delta in handle:
            results[delta.index].add(delta)
    return results


async def collect(request: Request, handle: RequestHandle) -> list[ChoiceResult]:
    """``gather``; aborts the request if the HTTP client disconnects first."""
    watcher = watch_disconnect(request, handle)
    try:
        return await gather(handle)
    finally:
        watcher.cancel()


def usage_counts(handle: RequestHandle, results: list[ChoiceResult], n: int) -> tuple[int, int, int]:
    """``(prompt, completion, cached)`` tokens: each prompt counts once; cached is its first sample's."""
    completion = sum(r.completion_tokens for r in results)
    cached = sum(results[j * n].cached_tokens for j in range(len(handle.prompt_tokens)))
    return sum(handle.prompt_tokens), completion, cached


async def sse_response(
    request: Request,
    handle: RequestHandle,
    events: AsyncIterator[bytes | str | tuple[str, bytes]],
    done: bool = True,
) -> StreamingResponse:
    """Server-sent events ``data: <json>`` from ``events`` (JSON bytes or text; an ``(event type,
    JSON)`` pair is sent as ``event: <type>`` and its data), then ``data: [DONE]`` (unless ``done``
    is false: the Responses API ends with its last typed event).

    The response starts with the request's first output: a request that fails retryably before it
    (overload, a worker gone) or passes its deadline answers 503 / 504 as a whole
    (``RequestHandle.first_output``). An error after the stream has started is sent as one
    ``data: {"error": ...}`` event (the status is already 200). The handle is closed, and its running
    choices aborted, when the client goes away.
    """
    watcher = watch_disconnect(request, handle)
    try:
        await handle.first_output()
    except BaseException:
        watcher.cancel()
        handle.close("failed before its first output")
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            async with handle:
                async for event in events:
                    yield _sse(event)
        except GatewayError as e:
            yield b"data: " + orjson.dumps(e.body()) + b"\n\n"
        finally:
            watcher.cancel()
        if done:
            yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _sse(event: bytes | str | tuple[str, bytes]) -> bytes:
    if isinstance(event, tuple):
        return b"event: " + event[0].encode() + b"\ndata: " + event[1] + b"\n\n"
    return b"data: " + (event if isinstance(event, bytes) else event.encode()) + b"\n\n"
