"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat path.

A request becomes a chat request (``ResponsesRequest.chat_request``, after the stored conversation
of its ``previous_response_id``) and is planned and submitted as one (``serving_chat.start_chat``:
the same request manager, grammars and tool-call / reasoning parsers); its one choice's text,
split by ``ChoiceParser``, becomes the response's output items, whole (``objects.output_items``)
or streamed (``stream.ResponseStream``). With ``store`` (the default) the response and its
conversation are kept for the API key that made it (``store.ResponseStore``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.services.gateway.auth import http_caller
from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.io_struct import TokenLogprob
from pdserve.services.gateway.openai.chat_output import ChatPlan, ChoiceParser
from pdserve.services.gateway.openai.responses.items import Item
from pdserve.services.gateway.openai.responses.objects import ResponseObject, ResponseUsage, output_items
from pdserve.services.gateway.openai.responses.protocol import ResponsesRequest
from pdserve.services.gateway.openai.responses.store import ResponseStore, StoredResponse
from pdserve.services.gateway.openai.responses.stream import Event, ResponseStream
from pdserve.services.gateway.openai.serving_chat import chat_logprobs, start_chat, without_stop_token
from pdserve.services.gateway.openai.serving_common import (
    ChoiceResult,
    ServingContext,
    collect,
    log_unknown_fields,
    new_rid,
    request_id,
    sse_response,
    usage_counts,
)
from pdserve.services.gateway.requests.state import RequestHandle


def not_found(response_id: str, param: str | None = None) -> GatewayError:
    """OpenAI's 404 for a response id this API key has not stored (or that is gone)."""
    if param == "previous_response_id":
        message = f"Previous response with id '{response_id}' not found."
        return GatewayError(404, message, param=param, code="previous_response_not_found")
    return GatewayError(404, f"Response with id '{response_id}' not found.")


class OpenAIServingResponses:
    def __init__(self, ctx: ServingContext, store: ResponseStore) -> None:
        self.ctx = ctx
        self.store = store

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        """Serve one Responses request. Raises ``GatewayError`` for every failure before streaming
        starts (404 for an unknown ``previous_response_id``)."""
        rid = request_id(request)
        log_unknown_fields(rid, body.unknown_fields())
        owner = http_caller(request)
        conversation: list[Item] = []
        if body.previous_response_id is not None:
            previous = self.store.get(owner, body.previous_response_id)
            if previous is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            conversation = list(previous.conversation)
        inputs = body.input_items()
        plan, handle = await start_chat(self.ctx, body.chat_request(conversation, inputs), request, rid)
        if body.max_tool_calls is not None:
            plan = dataclasses.replace(
                plan, max_calls=min(plan.max_calls or body.max_tool_calls, body.max_tool_calls)
            )
        response = ResponseObject.start(f"resp_{new_rid()}", self.ctx.response_model(body.model), body)
        conversation += inputs
        if body.stream:
            events = self._events(body, plan, handle, response, owner, conversation)
            return await sse_response(request, handle, events, done=False)
        results = await collect(request, handle)
        result = results[0]
        text = await without_stop_token(self.ctx, plan, result.text, result.matched_stop)
        logprobs = await self._logprobs(result.logprobs) if body.logprobs else None
        output = output_items(ChoiceParser(plan).parse(text), result.finish_reason, logprobs)
        response.finish(output, result.finish_reason, ResponseUsage.of(*usage_counts(handle, results, 1)))
        self._keep(owner, response, conversation)
        return JSONResponse(response.dump())

    def retrieve(self, response_id: str, request: Request) -> JSONResponse:
        """GET /v1/responses/{id}: the stored response; 404 when this key has none by that id."""
        entry = self.store.get(http_caller(request), response_id)
        if entry is None:
            raise not_found(response_id)
        return JSONResponse(entry.response)

    def delete(self, response_id: str, request: Request) -> JSONResponse:
        """DELETE /v1/responses/{id}: drop the stored response; 404 when this key has none by that id."""
        if not self.store.delete(http_caller(request), response_id):
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def _events(
        self,
        body: ResponsesRequest,
        plan: ChatPlan,
        handle: RequestHandle,
        response: ResponseObject,
        owner: str | None,
        conversation: list[Item],
    ) -> AsyncIterator[Event]:
        stream = ResponseStream(response)
        for event in stream.start():
            yield event
        result, parser = ChoiceResult(0), ChoiceParser(plan)
        try:
            async for delta in handle:
                result.add(delta)
                text = await without_stop_token(self.ctx, plan, delta.text, delta.matched_stop)
                reasoning, content, calls = parser.feed_piece(text, delta.finish_reason is not None)
                logprobs = await self._logprobs(delta.logprobs) if body.logprobs and delta.logprobs else []
                for event in stream.feed(reasoning, content, calls, logprobs):
                    yield event
        except GatewayError as e:
            for event in stream.fail(e):
                yield event
            return
        usage = ResponseUsage.of(*usage_counts(handle, [result], 1))
        for event in stream.finish(result.finish_reason, usage):
            yield event
        self._keep(owner, response, conversation)

    def _keep(self, owner: str | None, response: ResponseObject, conversation: list[Item]) -> None:
        if response.store:
            self.store.put(
                owner, response.id, StoredResponse(response.dump(), conversation + response.output)
            )

    async def _logprobs(self, logprobs: list[TokenLogprob]) -> list[dict]:
        """Logprob entries in the Responses shape (that of chat's: token, logprob, bytes, top_logprobs)."""
        return [entry.model_dump() for entry in (await chat_logprobs(self.ctx, logprobs)).content]
