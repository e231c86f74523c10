"""POST /v1/completions: OpenAI text completions, for one prompt or a batch, streamed or not.

Choice ``j * n + i`` is sample i of prompt j. ``echo`` prepends the prompt text (decoded by the
tokenizer service for token-id prompts); ``echo`` with ``logprobs`` also scores the prompt: its tokens
lead the choice's legacy logprobs (``prompt_logprobs.echo_logprobs``), which is how evaluation
harnesses score a model. ``max_tokens`` 0 (with ``echo``) returns the prompt alone. vLLM's
``prompt_logprobs`` come back in each choice (not streamed).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.services.gateway.io_struct import ChoiceDelta, GenerateReqInput, TokenLogprob
from pdserve.services.gateway.openai.legacy_logprobs import TextOffsets, append_token, joined, split_at
from pdserve.services.gateway.openai.prompt_logprobs import echo_logprobs, vllm_prompt_logprobs
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
        adapter = self.ctx.check_model(body.model)
        rid = request_id(request)
        log_unknown_fields(rid, body.unknown_fields())
        prompts = body.prompts()
        sampling = body.sampling_params(body.logprobs is not None, body.logprobs or 0, body.constraint)
        sampling.lora_name = adapter
        echoes = [await self._prompt_text(p) for p in prompts] if body.echo else None
        handle = await submit(request, self.ctx.manager, GenerateReqInput(rid, prompts, sampling, n=body.n))
        if body.stream:
            return await sse_response(request, handle, self._chunks(body, handle, echoes))
        results = await collect(request, handle)
        pieces = self.ctx.manager.token_pieces
        choices = []
        for r in results:
            if body.prompt_only:
                _drop_generated(r)
            prefix = echoes[r.index // body.n] if echoes else ""
            prompt_ids = handle.states[r.index].input_ids
            logprobs, offsets = None, TextOffsets()
            if body.scores_echo:
                logprobs = await echo_logprobs(pieces, prompt_ids, r.prompt_logprobs, body.logprobs, offsets)
            if body.logprobs is not None:
                generated = await self._logprobs(r.logprobs, offsets)
                logprobs = joined(logprobs, generated)
                if isinstance(r.matched_stop, str):
                    logprobs = split_at(logprobs, len(prefix + r.text))[0]
            scored = None
            if body.prompt_logprobs is not None:
                top = body.prompt_logprobs
                scored = await vllm_prompt_logprobs(pieces, prompt_ids, r.prompt_logprobs, top)
            choices.append(
                CompletionChoice(
                    index=r.index,
                    text=prefix + r.text,
                    logprobs=logprobs,
                    finish_reason=r.finish_reason,
                    matched_stop=r.matched_stop,
                    prompt_logprobs=scored,
                )
            )
        response = CompletionResponse(
            id=f"cmpl-{rid}",
            model=self.ctx.response_model(body.model),
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
        encoder = ChunkEncoder("text_completion", f"cmpl-{handle.rid}", self.ctx.response_model(body.model))
        results = [ChoiceResult(s.index) for s in handle.states]
        offsets = [TextOffsets() for _ in results]  # text_offset of each choice's next token
        text_lens = [0] * len(results)  # characters of each choice's text sent with logprobs
        held = [CompletionLogprobs() for _ in results]  # entries of tokens whose text is not sent yet
        if echoes and not body.scores_echo:
            for r in results:
                yield encoder.encode([completion_choice(r.index, echoes[r.index // body.n])])
        echoed = [False] * len(results)
        async for delta in handle:
            if body.prompt_only:
                _drop_generated(delta)
            results[delta.index].add(delta)
            if body.scores_echo and not echoed[delta.index]:  # its first output: the scored prompt
                echoed[delta.index] = True
                prompt_ids = handle.states[delta.index].input_ids
                pieces = self.ctx.manager.token_pieces
                logprobs = await echo_logprobs(
                    pieces, prompt_ids, delta.prompt_logprobs, body.logprobs, offsets[delta.index]
                )
                echo = echoes[delta.index // body.n]
                text_lens[delta.index] = len(echo)
                yield encoder.encode([completion_choice(delta.index, echo, logprobs)])
            if not (delta.text or delta.finish_reason or delta.logprobs):
                continue
            logprobs = None
            if body.logprobs is not None:
                i = delta.index
                pending = joined(held[i], await self._logprobs(delta.logprobs, offsets[i]))
                text_lens[i] += len(delta.text)
                if delta.finish_reason is not None and not isinstance(delta.matched_stop, str):
                    logprobs, held[i] = pending, CompletionLogprobs()
                else:  # a token waits for its text; a matched stop string's tokens never go out
                    logprobs, held[i] = split_at(pending, text_lens[i])
                if not (delta.text or delta.finish_reason or logprobs.tokens):
                    continue
            choice = completion_choice(
                delta.index, delta.text, logprobs, delta.finish_reason, delta.matched_stop
            )
            usage = UsageInfo.of(*usage_counts(handle, results, body.n)) if body.continuous_usage else None
            yield encoder.encode([choice], usage)
        if body.include_usage:
            yield encoder.encode([], UsageInfo.of(*usage_counts(handle, results, body.n)))

    async def _logprobs(self, logprobs: list[TokenLogprob], offsets: TextOffsets) -> CompletionLogprobs:
        """Legacy completions logprobs of generated tokens (``legacy_logprobs``; token texts distinct:
        a partial UTF-8 character shows as ``\\xNN``), their offsets taken from ``offsets``."""
        pieces = await self.ctx.manager.token_pieces.get(
            [lp.token_id for lp in logprobs] + [t.token_id for lp in logprobs for t in lp.top]
        )
        out = CompletionLogprobs()
        for lp in logprobs:
            append_token(out, pieces, offsets, lp.token_id, lp.logprob, lp.top)
        return out


def _drop_generated(out: ChoiceResult | ChoiceDelta) -> None:
    """``max_tokens`` 0: the one token the runtime generated is not the client's."""
    out.text, out.token_ids, out.logprobs, out.completion_tokens = "", [], [], 0
    if out.finish_reason is not None and out.finish_reason != "error":
        out.finish_reason, out.matched_stop = "length", None
