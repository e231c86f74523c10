"""POST /v1/chat/completions: OpenAI chat requests in, chat completions or SSE chunks out.

The messages are rendered by the tokenizer service with the model's chat template. ``plan_chat``
gives the request its grammar (``response_format``, ``structured_outputs``, a forced tool call)
and how its text is read back: ``reasoning_content``, ``content`` and ``tool_calls``
(``ChoiceParser``). Streams send, per choice, a first chunk with the assistant role, then deltas
of those three, and a last chunk with ``finish_reason`` ("tool_calls" when the choice called
tools); with ``stream_options.include_usage`` a final chunk carries the usage. vLLM's
``prompt_logprobs`` (not streamed) come back beside the choices, as vLLM puts them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.services.gateway.io_struct import GenerateReqInput, TokenLogprob
from pdserve.services.gateway.openai.chat_output import ChatPlan, ChoiceParser, plan_chat
from pdserve.services.gateway.openai.prompt_logprobs import vllm_prompt_logprobs
from pdserve.services.gateway.openai.protocol import ChatCompletionRequest
from pdserve.services.gateway.openai.protocol_responses import (
    AssistantMessage,
    CalledFunction,
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    DeltaFunction,
    DeltaToolCall,
    ToolCallOut,
    TopLogprobEntry,
    UsageInfo,
)
from pdserve.services.gateway.openai.serving_common import (
    ChoiceResult,
    ServingContext,
    collect,
    log_unknown_fields,
    request_id,
    sse_response,
    submit,
    usage_counts,
)
from pdserve.services.gateway.openai.stream_chunks import ChunkEncoder, chat_choice
from pdserve.services.gateway.openai.tool_parsers import ToolCallDelta
from pdserve.services.gateway.requests.state import RequestHandle


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        """Serve one chat request. Raises ``GatewayError`` for every failure before streaming starts."""
        plan, handle = await start_chat(self.ctx, body, request, request_id(request))
        rid = handle.rid
        if body.stream:
            return await sse_response(request, handle, self._chunks(body, plan, handle))
        results = await collect(request, handle)
        prompt_tokens, completion_tokens, cached = usage_counts(handle, results, body.n)
        for r in results:
            r.text = await without_stop_token(self.ctx, plan, r.text, r.matched_stop)
        choices = [await self._choice(body, plan, r) for r in results]
        scored = None
        if body.prompt_logprobs is not None:  # every choice has the same prompt: the first's
            pieces, prompt_ids = self.ctx.manager.token_pieces, handle.states[0].input_ids
            first = results[0].prompt_logprobs
            scored = await vllm_prompt_logprobs(pieces, prompt_ids, first, body.prompt_logprobs)
        response = ChatCompletionResponse(
            id=f"chatcmpl-{rid}",
            model=self.ctx.response_model(body.model),
            choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens, cached),
            prompt_logprobs=scored,
        )
        return JSONResponse(response.model_dump())

    async def _choice(self, body: ChatCompletionRequest, plan: ChatPlan, r: ChoiceResult) -> ChatChoice:
        out = ChoiceParser(plan).parse(r.text)
        calls = [
            ToolCallOut(id=c.id, function=CalledFunction(name=c.name, arguments=c.arguments))
            for c in out.tool_calls
        ]
        return ChatChoice(
            index=r.index,
            message=AssistantMessage(content=out.content, reasoning_content=out.reasoning, tool_calls=calls),
            logprobs=await chat_logprobs(self.ctx, r.logprobs) if body.logprobs else None,
            finish_reason=_finish_reason(r.finish_reason, bool(calls)),
            matched_stop=r.matched_stop,
        )

    async def _chunks(
        self, body: ChatCompletionRequest, plan: ChatPlan, handle: RequestHandle
    ) -> AsyncIterator[bytes]:
        encoder = ChunkEncoder(
            "chat.completion.chunk", f"chatcmpl-{handle.rid}", self.ctx.response_model(body.model)
        )
        results = [ChoiceResult(s.index) for s in handle.states]
        parsers = [ChoiceParser(plan) for _ in results]
        for r in results:
            yield encoder.encode([chat_choice(r.index, "", role="assistant")])
        async for delta in handle:
            result, parser = results[delta.index], parsers[delta.index]
            result.add(delta)
            text = await without_stop_token(self.ctx, plan, delta.text, delta.matched_stop)
            reasoning, content, calls = parser.feed_piece(text, delta.finish_reason is not None)
            if not (reasoning or content or calls or delta.finish_reason or delta.logprobs):
                continue
            choice = chat_choice(
                delta.index,
                content or None,
                logprobs=await chat_logprobs(self.ctx, delta.logprobs) if body.logprobs else None,
                finish_reason=_finish_reason(delta.finish_reason, parser.called),
                matched_stop=delta.matched_stop,
                reasoning_content=reasoning or None,
                tool_calls=_delta_calls(calls),
            )
            usage = self._usage(handle, results, body) if body.continuous_usage else None
            yield encoder.encode([choice], usage)
        if body.include_usage:
            yield encoder.encode([], self._usage(handle, results, body))

    @staticmethod
    def _usage(handle: RequestHandle, results: list[ChoiceResult], body: ChatCompletionRequest) -> UsageInfo:
        return UsageInfo.of(*usage_counts(handle, results, body.n))


async def start_chat(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request, rid: str
) -> tuple[ChatPlan, RequestHandle]:
    """Plan ``body`` (its grammar and output parsers, ``plan_chat``) and submit it as request ``rid``
    (/v1/chat/completions, and /v1/responses as the chat request it becomes).

    Raises:
        GatewayError: what ``plan_chat`` and ``submit`` raise; 404 for a model not served.
    """
    adapter = ctx.check_model(body.model)
    log_unknown_fields(rid, body.unknown_fields())
    parsers = await ctx.chat_parsers()
    plan = plan_chat(body, parsers.tools, parsers.reasoning, parsers.think_tokens)
    sampling = body.sampling_params(body.logprobs, body.top_logprobs or 0, plan.constraint)
    sampling.lora_name = adapter
    if plan.tools is not None and not plan.tools.skip_special_tokens:
        sampling.skip_special_tokens = False  # the call marker is a special token
    obj = GenerateReqInput(rid, [body.chat_prompt()], sampling, n=body.n, add_special_tokens=False)
    return plan, await submit(request, ctx.manager, obj)


async def without_stop_token(
    ctx: ServingContext, plan: ChatPlan, text: str, matched_stop: str | int | None
) -> str:
    """``text`` without the stop token that ended it, where special tokens are kept for the
    tool-call parser (an EOS such as ``<|eot_id|>`` is not part of the answer)."""
    if plan.tools is None or plan.tools.skip_special_tokens or not isinstance(matched_stop, int):
        return text
    stop_text = (await ctx.manager.token_pieces.get([matched_stop]))[matched_stop].text
    return text.removesuffix(stop_text)


async def chat_logprobs(ctx: ServingContext, logprobs: list[TokenLogprob]) -> ChatLogprobs:
    """OpenAI chat logprobs: per token its text, its real bytes (those of its piece: a token that
    holds part of a UTF-8 character keeps them), logprob and ``top_logprobs`` alternatives."""
    pieces = await ctx.manager.token_pieces.get(
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


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a choice that ended normally after calling tools."""
    return "tool_calls" if reason == "stop" and called else reason


def _delta_calls(calls: list[ToolCallDelta]) -> list[DeltaToolCall]:
    return [
        DeltaToolCall(
            index=c.index,
            id=c.id,
            type="function" if c.id else None,
            function=DeltaFunction(name=c.name, arguments=c.arguments),
        )
        for c in calls
    ]
