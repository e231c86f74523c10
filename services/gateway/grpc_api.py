"""The public gRPC API (``pdserve.v1.PdServe``) used by the SDK: Generate, Abort, ListModels.

Generate streams ``GenerateResponse`` pieces (index per choice, usage on each choice's last piece).
Sampling parameters are validated by the same model as native /generate. A call that is cancelled
or passes its gRPC deadline aborts its request in the schedulers. Failures abort the call with the
status code of the ``GatewayError`` (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, ...).
With an API key configured, every method first checks the call's ``authorization`` metadata.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from pydantic import ValidationError

from pdserve.services.gateway import convert
from pdserve.services.gateway.errors import GatewayError, generation_failed, invalid_request
from pdserve.services.gateway.io_struct import GenerateReqInput, Prompt
from pdserve.services.gateway.native_protocol import NativeSamplingParams
from pdserve.services.gateway.protocol import MAX_TOP_LOGPROBS
from pdserve.services.gateway.serving_common import ServingContext, new_rid
from pdserve.v1 import api_pb2, api_pb2_grpc


class PdServeServicer(api_pb2_grpc.PdServeServicer):
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def Generate(
        self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        try:
            obj = self._to_generate_req(request)
            handle = await self.ctx.manager.submit(obj, timeout=context.time_remaining())
        except GatewayError as e:
            await context.abort(e.grpc_code, e.message)
        # The handle is closed (and its choices aborted) when the call ends for any reason.
        context.add_done_callback(lambda _ctx: handle.close("rpc ended"))
        try:
            async with handle:
                async for delta in handle:
                    if delta.finish_reason == "error":
                        raise generation_failed(delta.error)
                    yield convert.generate_response_to_pb(obj.rid, delta)
        except GatewayError as e:
            await context.abort(e.grpc_code, e.message)

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
            prompt = convert.chat_prompt_from_pb(request.chat)
        else:
            raise invalid_request("one of text, input_ids or chat is required", param="input")
        if not prompt or (which == "chat" and not prompt.messages):
            raise invalid_request(f"'{which}' must not be empty", param=which)
        fields = convert.sampling_params_dict(request.sampling_params)
        return_logprob = fields.pop("return_logprob", False)
        top_logprobs_num = fields.pop("top_logprobs_num", 0)
        fields["n"] = fields.get("n") or 1
        try:
            params = NativeSamplingParams.model_validate(fields)
        except ValidationError as e:
            err = e.errors()[0]
            param = (err.get("ctx") or {}).get("param") or ".".join(str(p) for p in err["loc"])
            raise invalid_request(f"sampling_params.{param}: {err['msg']}", param=param) from None
        if not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise invalid_request(
                f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs_num"
            )
        return GenerateReqInput(
            rid=request.rid or new_rid(),
            prompts=[prompt],
            sampling_params=params.to_sampling_params(return_logprob, top_logprobs_num),
            n=params.n,
            add_special_tokens=which != "chat",
        )

    async def Abort(
        self, request: api_pb2.PublicAbortRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.PublicAbortResponse:
        return api_pb2.PublicAbortResponse(found=self.ctx.manager.abort(request.rid))

    async def ListModels(
        self, request: api_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.ListModelsResponse:
        try:
            info = await self.ctx.manager.model_info()
        except GatewayError as e:
            await context.abort(e.grpc_code, e.message)
        card = api_pb2.ModelCard(id=self.ctx.served_model_name, context_length=info.context_length)
        return api_pb2.ListModelsResponse(models=[card])
