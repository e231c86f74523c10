"""POST /v1/completions: OpenAI text completions, for one prompt or a batch, streamed or not.

Choice ``j * n + i`` is sample i of prompt j. ``echo`` prepends the prompt text (decoded by the
tokenizer service for token-id prompts); ``echo`` with ``logprobs`` is refused with 400 because the
runtime does not compute prompt logprobs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.services.gateway.io_struct import GenerateReqInput, TokenLogprob
from pdserve.services.gateway.openai.protocol import CompletionRequest
from pdserve.services.gateway.openai.protocol_responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
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
from pdserve.services.gateway.openai.stream_chunks import ChunkEncoder, completion_choice
from pdserve.services.gateway.requests.state import RequestHandle


class OpenAIServingCompletion:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        """Serve one completions request. Raises ``GatewayError`` for every failure before streaming."""
        self.ctx.check_model(body.model)
        rid = request_id(request)
        log_unknown_fields(rid, body.unknown_fields())
        prompts = body.prompts()
        sampling = body.sampling_params(body.logprobs is not None, body.logprobs or 0, body.constraint)
        echoes = [await self._prompt_text(p) for p in prompts] if body.echo else None
        handle = await submit(request, self.ctx.manager, GenerateReqInput(rid, prompts, sampling, n=body.n))
        if body.stream:
            return await sse_response(request, handle, self._chunks(body, handle, echoes))
        results = await collect(request, handle)
        choices = []
        for r in results:
            prefix = echoes[r.index // body.n] if echoes else ""
            logprobs = await self._logprobs(r.logprobs, 0) if body.logprobs is not None else None
            choices.append(
                CompletionChoice(
                    index=r.index,
                    text=prefix + r.text,
                    logprobs=logprobs,
                    finish_reason=r.finish_reason,
                    matched_stop=r.matched_stop,
                )
            )
        response = CompletionResponse(
            id=f"cmpl-{rid}",
            model=self.ctx.served_model_name,
            choices=choices,
            usage=UsageInfo.of(*usage_counts(handle, results, body.n)),
        )
        return JSONResponse(response.model_dump())

    async def _prompt_text(self, prompt: str | list[int]) -> str:
        """The echoed text of ``prompt``; token ids are checked against the vocabulary first."""
        if isinstance(prompt, str):
            return prompt
        await self.ctx.manager.check_token_ids(prompt)
        return await self.ctx.manager.detokenize(prompt)

    async def _chunks(
        self, body: CompletionRequest, handle: RequestHandle, echoes: list[str] | None
    ) -> AsyncIterator[bytes]:
        encoder = ChunkEncoder("text_completion", f"cmpl-{handle.rid}", self.ctx.served_model_name)
        results = [ChoiceResult(s.index) for s in handle.states]
        offsets = [0] * len(results)  # text_offset of each choice's next token
        if echoes:
            for r in results:
                yield encoder.encode([completion_choice(r.index, echoes[r.index // body.n])])
        async for delta in handle:
            results[delta.index].add(delta)
            if not (delta.text or delta.finish_reason or delta.logprobs):
                continue
            logprobs = None
            if body.logprobs is not None:
                logprobs = await self._logprobs(delta.logprobs, offsets[delta.index])
                offsets[delta.index] += sum(len(t) for t in logprobs.tokens)
            choice = completion_choice(
                delta.index, delta.text, logprobs, delta.finish_reason, delta.matched_stop
            )
            usage = UsageInfo.of(*usage_counts(handle, results, body.n)) if body.continuous_usage else None
            yield encoder.encode([choice], usage)
        if body.include_usage:
            yield encoder.encode([], UsageInfo.of(*usage_counts(handle, results, body.n)))

    async def _logprobs(self, logprobs: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        """Legacy completions logprobs (token texts distinct: a partial UTF-8 character shows as
        ``\\xNN``); ``text_offset`` counts token text lengths from ``offset``."""
        pieces = await self.ctx.manager.token_pieces.get(
            [lp.token_id for lp in logprobs] + [t.token_id for lp in logprobs for t in lp.top]
        )
        out = CompletionLogprobs()
        for lp in logprobs:
            out.tokens.append(pieces[lp.token_id].text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({pieces[t.token_id].text: t.logprob for t in lp.top})
            out.text_offset.append(offset)
            offset += len(pieces[lp.token_id].text)
        return out
