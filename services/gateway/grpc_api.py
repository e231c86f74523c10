"""The public gRPC API (``pdserve.v1.PdServe``) used by the SDK: Generate, Abort, ListModels.

Generate streams ``GenerateResponse`` pieces (index per choice, usage on each choice's last piece).
A request is validated by the models of the HTTP API and refused with the same message: its options
(sampling parameters, rid, logprobs) as native /generate's (``GenerateOptions``), a ``chat`` input as
/v1/chat/completions' messages, tools and template options (``ChatInput``). A call that is cancelled
or passes its gRPC deadline aborts its request in the schedulers. Failures abort the call with the
status code of the ``GatewayError`` (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, ...);
RESOURCE_EXHAUSTED and UNAVAILABLE carry their retry hint in the trailing metadata (``abort_with``).
With API keys configured, every method first checks the call's ``authorization`` metadata, and a
request can be aborted only with the key it was sent with (any other caller is told ``found=false``).
A request message that does not parse is refused with INVALID_ARGUMENT (``MalformedRequestInterceptor``).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from fastapi.exceptions import RequestValidationError
from google.protobuf import descriptor_pool
from google.protobuf.message import DecodeError
from pydantic import BaseModel, ValidationError

from pdserve.services.gateway import convert
from pdserve.services.gateway.auth import grpc_caller
from pdserve.services.gateway.errors import (
    GatewayError,
    generation_failed,
    invalid_request,
    validation_to_gateway_error,
)
from pdserve.services.gateway.io_struct import GenerateReqInput, Prompt
from pdserve.services.gateway.native_protocol import GenerateOptions
from pdserve.services.gateway.protocol import ChatInput
from pdserve.services.gateway.serving_common import ServingContext, new_rid
from pdserve.v1 import api_pb2, api_pb2_grpc, tokenizer_pb2

_Model = TypeVar("_Model", bound=BaseModel)

# gRPC ends a call at its deadline itself (DEADLINE_EXCEEDED to the client, the handler cancelled);
# the gateway's own timer for the call runs this much later so that the two never race to end it
# (aborting a call gRPC had just ended failed in gRPC's core and was logged as an error).
DEADLINE_GRACE_S = 0.5


class PdServeServicer(api_pb2_grpc.PdServeServicer):
    """``api_keys``: the gateway's API keys (empty: none), whose holders own the requests they send."""

    def __init__(self, ctx: ServingContext, api_keys: Sequence[str] = ()) -> None:
        self.ctx = ctx
        self.api_keys = api_keys

    async def Generate(
        self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        try:
            obj = self._to_generate_req(request)
            remaining = context.time_remaining()
            timeout = None if remaining is None else remaining + DEADLINE_GRACE_S
            owner = grpc_caller(context, self.api_keys)
            handle = await self.ctx.manager.submit(obj, timeout=timeout, owner=owner)
        except GatewayError as e:
            await abort_with(context, e)
        # The handle is closed (and its choices aborted) when the call ends for any reason.
        context.add_done_callback(lambda _ctx: handle.close("rpc ended"))
        try:
            async with handle:
                async for delta in handle:
                    if delta.finish_reason == "error":
                        raise generation_failed(delta.error, delta.retryable)
                    yield convert.generate_response_to_pb(obj.rid, delta)
        except GatewayError as e:
            await abort_with(context, e)

    def _to_generate_req(self, request: api_pb2.GenerateRequest) -> GenerateReqInput:
        if request.model:
            self.ctx.check_model(request.model)
        which = request.WhichOneof("input")
        prompt: Prompt
        if which == "text":
            prompt = request.text
        elif which == "input_ids":
            prompt = list(request.input_ids.ids)
        elif which == "chat":
            prompt = validate_as_body(ChatInput, _chat_fields(request.chat)).chat_prompt()
        else:
            raise invalid_request("one of text, input_ids or chat is required", param="input")
        if not prompt:
            raise invalid_request(f"'{which}' must not be empty", param=which)
        # return_logprob and top_logprobs_num travel in SamplingParams; /generate has them top-level
        sampling = convert.sampling_params_dict(request.sampling_params)
        logprob_options = {
            "return_logprob": sampling.pop("return_logprob", False),
            "top_logprobs_num": sampling.pop("top_logprobs_num", 0),
        }
        options = validate_as_body(
            GenerateOptions, {"sampling_params": sampling, "rid": request.rid or None, **logprob_options}
        )
        params = options.sampling_params
        return GenerateReqInput(
            rid=options.rid or new_rid(),
            prompts=[prompt],
            sampling_params=params.to_sampling_params(options.return_logprob, options.top_logprobs_num),
            n=params.n,
            add_special_tokens=which != "chat",
            params_path="sampling_params.",
        )

    async def Abort(
        self, request: api_pb2.PublicAbortRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.PublicAbortResponse:
        found = self.ctx.manager.abort(request.rid, owner=grpc_caller(context, self.api_keys))
        return api_pb2.PublicAbortResponse(found=found)

    async def ListModels(
        self, request: api_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.ListModelsResponse:
        try:
            info = await self.ctx.manager.model_info()
        except GatewayError as e:
            await abort_with(context, e)
        card = api_pb2.ModelCard(id=self.ctx.served_model_name, context_length=info.context_length)
        return api_pb2.ListModelsResponse(models=[card])


async def abort_with(context: grpc.aio.ServicerContext, error: GatewayError) -> None:
    """End the call with ``error``'s status code and message. An error the client should retry
    (429/503 with ``Retry-After``) carries the hint in the trailing metadata twice: ``retry-after``
    (seconds, as HTTP's header) and ``grpc-retry-pushback-ms``, which gRPC's own retry policy (gRFC
    A6, as the SDK configures it for UNAVAILABLE) waits for before it retries."""
    metadata: tuple[tuple[str, str], ...] = ()
    if "Retry-After" in error.headers:
        seconds = error.headers["Retry-After"]
        metadata = (("retry-after", seconds), ("grpc-retry-pushback-ms", str(int(float(seconds) * 1000))))
    await context.abort(error.grpc_code, error.message, trailing_metadata=metadata)


def _chat_fields(chat: tokenizer_pb2.ChatMessages) -> dict[str, Any]:
    """``chat`` as the JSON fields of /v1/chat/completions (tools with ``tool_choice='none'``, the
    only choice this API has: it returns text, never parsed tool calls).

    Raises:
        GatewayError: 400 when ``tools_json``, ``chat_template_kwargs_json`` or a message's
            ``tool_calls_json`` is not JSON.
    """
    fields: dict[str, Any] = {
        "messages": [_message_fields(i, m) for i, m in enumerate(chat.messages)],
        "add_generation_prompt": chat.add_generation_prompt,
        "continue_final_message": chat.continue_final_message,
    }
    for name, text in (("tools", chat.tools_json), ("chat_template_kwargs", chat.chat_template_kwargs_json)):
        if text:
            fields[name] = _json_field(f"{name}_json", text)
    if chat.tools_json:
        fields["tool_choice"] = "none"  # this API never parses tool calls: tools are shown to the template
    return fields


def _message_fields(index: int, m: tokenizer_pb2.ChatMessage) -> dict[str, Any]:
    """One ``ChatMessage`` as /v1/chat/completions' JSON (its empty fields left out)."""
    fields: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        fields["name"] = m.name
    if m.tool_calls_json:
        fields["tool_calls"] = _json_field(f"messages[{index}].tool_calls_json", m.tool_calls_json)
    if m.tool_call_id:
        fields["tool_call_id"] = m.tool_call_id
    return fields


def _json_field(name: str, text: str) -> Any:
    """Raises ``GatewayError`` 400 when ``text`` is not JSON (or nests too deep to parse)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep to parse
        raise invalid_request(f"'{name}' is not valid JSON: {e}", param=name) from None


def validate_as_body(model: type[_Model], fields: dict[str, Any]) -> _Model:
    """``fields`` validated by ``model``; a failure raises the 400 HTTP answers for that JSON body."""
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        as_body = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        raise validation_to_gateway_error(RequestValidationError(as_body)) from None


@dataclass(frozen=True, slots=True)
class _Malformed:
    """Handed to a method in place of a request message that did not parse; ``message`` says why."""

    message: str


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT ("request is not a valid pdserve.v1.GenerateRequest: ...") for a request
    message that does not parse, on every method with a unary request (stream-request methods pass
    through unchanged).

    grpcio parses the request before the method runs, and answers a parse failure with UNKNOWN and a
    logged traceback; here the parse failure becomes a ``_Malformed`` value that the wrapped method
    refuses before the servicer sees it. Place it after ``ApiKeyInterceptor``, whose refusal then
    wins over a malformed request's.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}  # by method: built once, not per call

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        wrapped = self._wrapped.get(details.method)
        if wrapped is None:
            wrapped = self._wrapped[details.method] = self._wrap(details.method, handler)
        return wrapped

    @staticmethod
    def _wrap(full_method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        service, _, method = full_method.lstrip("/").rpartition("/")
        name = descriptor_pool.Default().FindMethodByName(f"{service}.{method}").input_type.full_name
        parse = handler.request_deserializer

        def parse_or_flag(data: bytes) -> Any:
            try:
                return parse(data)
            except DecodeError as e:
                return _Malformed(f"request is not a valid {name}: {e}")

        streams = handler.response_streaming
        make = grpc.unary_stream_rpc_method_handler if streams else grpc.unary_unary_rpc_method_handler
        behavior = _refusing_malformed(handler.unary_stream if streams else handler.unary_unary)
        return make(
            behavior, request_deserializer=parse_or_flag, response_serializer=handler.response_serializer
        )


def _refusing_malformed(behavior: Callable) -> Callable:
    """``behavior`` (a coroutine or async-generator method) ending the call with INVALID_ARGUMENT when
    its request is ``_Malformed``."""
    if inspect.isasyncgenfunction(behavior):

        async def streaming(request, context: grpc.aio.ServicerContext):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in behavior(request, context):
                yield response

        return streaming

    async def unary(request, context: grpc.aio.ServicerContext):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return unary
