"""The public gRPC API (``pdserve.v1.PdServe``) used by the SDK: Generate, Embed, Abort, ListModels,
and the operator calls LoadLoraAdapter / UnloadLoraAdapter (``LoraAdmin``, as the HTTP endpoints).

Embed answers as /v1/embeddings (``serving_embeddings``: the same request model and bounds), float32
vectors in input order.

Generate streams ``GenerateResponse`` pieces (index per choice, usage on each choice's last piece).
A request is validated by the models of the HTTP API and refused with the same message: its options
(sampling parameters, rid, logprobs) as native /generate's (``GenerateOptions``), a ``chat`` input as
/v1/chat/completions' messages, tools and template options (``ChatInput``). A call that is cancelled
or passes its gRPC deadline aborts its request in the schedulers. Failures abort the call with the
status code of the ``GatewayError`` (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, ...);
RESOURCE_EXHAUSTED and UNAVAILABLE carry their retry hint in the trailing metadata (``abort_with``).
With API keys configured, every method first checks the call's ``authorization`` metadata, and a
request can be aborted only with the key it was sent with (any other caller is told ``found=false``).
A request message that does not parse is refused with INVALID_ARGUMENT (``interceptors``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from pdserve.services.gateway.auth import grpc_caller
from pdserve.services.gateway.errors import (
    GatewayError,
    generation_failed,
    invalid_request,
    validate_as_body,
)
from pdserve.services.gateway.io_struct import GenerateReqInput, Prompt
from pdserve.services.gateway.lora_admin import LoadLoraAdapterRequest, LoraAdmin, UnloadLoraAdapterRequest
from pdserve.services.gateway.openai.native_protocol import GenerateOptions
from pdserve.services.gateway.openai.protocol import ChatInput
from pdserve.services.gateway.openai.serving_common import ServingContext, gather, new_rid
from pdserve.services.gateway.openai.serving_embeddings import EmbeddingRequest
from pdserve.services.gateway.requests.state import RequestHandle
from pdserve.services.gateway.transport import convert
from pdserve.v1 import api_pb2, api_pb2_grpc

# gRPC ends a call at its deadline itself (DEADLINE_EXCEEDED to the client, the handler cancelled);
# the gateway's own timer for the call runs this much later so that the two never race to end it
# (aborting a call gRPC had just ended failed in gRPC's core and was logged as an error).
DEADLINE_GRACE_S = 0.5

SERVICE_NAME = api_pb2.DESCRIPTOR.services_by_name["PdServe"].full_name
add_to_server = api_pb2_grpc.add_PdServeServicer_to_server


class PdServeServicer(api_pb2_grpc.PdServeServicer):
    """``api_keys``: the gateway's API keys (empty: none), whose holders own the requests they send;
    ``lora``: the run-time LoRA adapter changes (``LoraAdmin``)."""

    def __init__(self, ctx: ServingContext, lora: LoraAdmin, api_keys: Sequence[str] = ()) -> None:
        self.ctx = ctx
        self.lora = lora
        self.api_keys = api_keys

    async def Generate(
        self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        try:
            obj = self._to_generate_req(request)
            handle = await self._submit(obj, context)
        except GatewayError as e:
            await abort_with(context, e)
        try:
            async with handle:
                async for delta in handle:
                    if delta.finish_reason == "error":
                        raise generation_failed(delta.error, delta.retryable)
                    yield convert.generate_response_to_pb(obj.rid, delta)
        except GatewayError as e:
            await abort_with(context, e)

    def _to_generate_req(self, request: api_pb2.GenerateRequest) -> GenerateReqInput:
        adapter = self.ctx.check_model(request.model) if request.model else ""
        which = request.WhichOneof("input")
        prompt: Prompt
        if which == "text":
            prompt = request.text
        elif which == "input_ids":
            prompt = list(request.input_ids.ids)
        elif which == "chat":
            prompt = validate_as_body(ChatInput, convert.chat_fields(request.chat)).chat_prompt()
        else:
            raise invalid_request("one of text, input_ids or chat is required", param="input")
        if not prompt:
            raise invalid_request(f"'{which}' must not be empty", param=which)
        # return_logprob, top_logprobs_num and priority travel in SamplingParams; /generate has them
        # top-level
        sampling = convert.sampling_params_dict(request.sampling_params)
        sampling.pop("lora_name", None)  # the adapter is the request's model
        top_level = {
            name: sampling.pop(name)
            for name in ("return_logprob", "top_logprobs_num", "priority")
            if name in sampling
        }
        options = validate_as_body(
            GenerateOptions, {"sampling_params": sampling, "rid": request.rid or None, **top_level}
        )
        engine_params = options.engine_sampling_params()
        engine_params.lora_name = adapter
        return GenerateReqInput(
            rid=options.rid or new_rid(),
            prompts=[prompt],
            sampling_params=engine_params,
            n=options.sampling_params.n,
            add_special_tokens=which != "chat",
            params_path="sampling_params.",
        )

    async def Embed(
        self, request: api_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.EmbedResponse:
        try:
            adapter = self.ctx.check_model(request.model) if request.model else ""
            body = validate_as_body(EmbeddingRequest, convert.embed_fields(request))
            obj = body.generate_req(request.rid or new_rid())
            obj.sampling_params.lora_name = adapter
            handle = await self._submit(obj, context)
        except GatewayError as e:
            await abort_with(context, e)
        try:
            results = await gather(handle)
            return convert.embed_response_to_pb(*body.answer(results, handle.prompt_tokens))
        except GatewayError as e:
            await abort_with(context, e)

    async def _submit(self, obj: GenerateReqInput, context: grpc.aio.ServicerContext) -> RequestHandle:
        """``obj`` submitted for the call's caller, within its deadline; the handle is closed (and its
        choices aborted) when the call ends for any reason. Raises ``GatewayError`` as ``submit``."""
        remaining = context.time_remaining()
        timeout = None if remaining is None else remaining + DEADLINE_GRACE_S
        owner = grpc_caller(context, self.api_keys)
        handle = await self.ctx.manager.submit(obj, timeout=timeout, owner=owner)
        context.add_done_callback(lambda _ctx: handle.close("rpc ended"))
        return handle

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
        cards = [
            api_pb2.ModelCard(id=name, context_length=info.context_length, parent=parent or "")
            for name, parent in self.ctx.listed_models()
        ]
        return api_pb2.ListModelsResponse(models=cards)

    async def LoadLoraAdapter(
        self, request: api_pb2.PublicLoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.PublicLoraAdapterResponse:
        """``POST /v1/load_lora_adapter``'s load, with its refusals as status codes."""
        fields = {"lora_name": request.lora_name, "lora_path": request.lora_path}
        try:
            message = await self.lora.load(validate_as_body(LoadLoraAdapterRequest, fields))
        except GatewayError as e:
            await abort_with(context, e)
        return api_pb2.PublicLoraAdapterResponse(message=message)

    async def UnloadLoraAdapter(
        self, request: api_pb2.PublicUnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.PublicLoraAdapterResponse:
        """``POST /v1/unload_lora_adapter``'s unload, with its refusals as status codes."""
        try:
            body = validate_as_body(UnloadLoraAdapterRequest, {"lora_name": request.lora_name})
            message = await self.lora.unload(body)
        except GatewayError as e:
            await abort_with(context, e)
        return api_pb2.PublicLoraAdapterResponse(message=message)


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
