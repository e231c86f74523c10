"""POST /v1/chat/completions: OpenAI chat requests in, chat completions or SSE chunks out.

The messages are rendered by the tokenizer service with the model's chat template. Streams send,
per choice, a first chunk with the assistant role, content deltas, and a last chunk with
``finish_reason``; with ``stream_options.include_usage`` a final chunk carries the usage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.services.gateway.io_struct import GenerateReqInput, TokenLogprob
from pdserve.services.gateway.protocol import ChatCompletionRequest
from pdserve.services.gateway.protocol_responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    TopLogprobEntry,
    UsageInfo,
)
from pdserve.services.gateway.request_state import RequestHandle
from pdserve.services.gateway.serving_common import (
    ChoiceResult,
    ServingContext,
    collect,
    request_id,
    sse_response,
    submit,
    usage_counts,
)
from pdserve.services.gateway.stream_chunks import ChunkEncoder, chat_choice


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        """Serve one chat request. Raises ``GatewayError`` for every failure before streaming starts."""
        self.ctx.check_model(body.model)
        rid = request_id(request)
        sampling = body.sampling_params(body.logprobs, body.top_logprobs or 0)
        obj = GenerateReqInput(rid, [body.chat_prompt()], sampling, n=body.n, add_special_tokens=False)
        handle = await submit(request, self.ctx.manager, obj)
        if body.stream:
            return await sse_response(request, handle, self._chunks(body, handle))
        results = await collect(request, handle)
        prompt_tokens, completion_tokens, cached = usage_counts(handle, results, body.n)
        choices = [
            ChatChoice(
                index=r.index,
                message=AssistantMessage(content=r.text),
                logprobs=await self._logprobs(r.logprobs) if body.logprobs else None,
                finish_reason=r.finish_reason,
                matched_stop=r.matched_stop,
            )
            for r in results
        ]
        response = ChatCompletionResponse(
            id=f"chatcmpl-{rid}",
            model=self.ctx.served_model_name,
            choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens, cached),
        )
        return JSONResponse(response.model_dump())

    async def _chunks(self, body: ChatCompletionRequest, handle: RequestHandle) -> AsyncIterator[bytes]:
        encoder = ChunkEncoder("chat.completion.chunk", f"chatcmpl-{handle.rid}", self.ctx.served_model_name)
        results = [ChoiceResult(s.index) for s in handle.states]
        for r in results:
            yield encoder.encode([chat_choice(r.index, "", role="assistant")])
        async for delta in handle:
            result = results[delta.index]
            result.add(delta)
            if not (delta.text or delta.finish_reason or delta.logprobs):
                continue
            choice = chat_choice(
                delta.index,
                delta.text or None,
                logprobs=await self._logprobs(delta.logprobs) if body.logprobs else None,
                finish_reason=delta.finish_reason,
                matched_stop=delta.matched_stop,
            )
            usage = self._usage(handle, results, body) if body.continuous_usage else None
            yield encoder.encode([choice], usage)
        if body.include_usage:
            yield encoder.encode([], self._usage(handle, results, body))

    @staticmethod
    def _usage(handle: RequestHandle, results: list[ChoiceResult], body: ChatCompletionRequest) -> UsageInfo:
        return UsageInfo.of(*usage_counts(handle, results, body.n))

    async def _logprobs(self, logprobs: list[TokenLogprob]) -> ChatLogprobs:
        """OpenAI chat logprobs: per token its text, its real bytes (those of its piece: a token that
        holds part of a UTF-8 character keeps them), logprob and ``top_logprobs`` alternatives."""
        pieces = await self.ctx.manager.token_pieces.get(
            [lp.token_id for lp in logprobs] + [t.token_id for lp in logprobs for t in lp.top]
        )

        def entry(token_id: int, logprob: float) -> TopLogprobEntry:
            piece = pieces[token_id]
            return TopLogprobEntry(token=piece.text, logprob=logprob, bytes=list(piece.data))

        content = [
            ChatLogprobEntry(
                **entry(lp.token_id, lp.logprob).model_dump(),
                top_logprobs=[entry(t.token_id, t.logprob) for t in lp.top],
            )
            for lp in logprobs
        ]
        return ChatLogprobs(content=content)
