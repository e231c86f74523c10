"""Native endpoints: SGLang-style POST /generate, and POST /tokenize, POST /detokenize.

/generate answers ``{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type", "matched"},
"prompt_tokens", "completion_tokens", "cached_tokens", ...}}`` (a list of those for a batch of
prompts or n > 1); with ``sampling_params.prompt_logprobs`` (vLLM's), ``meta_info`` adds SGLang's
``input_token_logprobs`` and ``input_top_logprobs``. Streamed chunks carry the text and ids
generated so far (SGLang's default), with ``index`` for a batch or n > 1.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.observability import tracing
from pdserve.observability.logs import bind_rid
from pdserve.services.gateway.errors import invalid_request
from pdserve.services.gateway.io_struct import ChatPrompt, GenerateReqInput, TokenLogprob
from pdserve.services.gateway.openai.native_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    FinishReasonInfo,
    MetaInfo,
    NativeGenerateRequest,
    NativeGenerateResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pdserve.services.gateway.openai.serving_common import (
    ChoiceResult,
    ServingContext,
    collect,
    sse_response,
    submit,
)
from pdserve.services.gateway.requests.state import RequestHandle


class NativeServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def generate(self, body: NativeGenerateRequest, request: Request) -> Response:
        """Serve POST /generate; ``rid`` in the body replaces the ``X-Request-Id`` rid."""
        adapter = self.ctx.check_model(body.model, required=False)
        if body.rid:
            request.state.rid = body.rid
            bind_rid(body.rid)
            tracing.tag_current_span(body.rid)
        rid = request.state.rid
        sp = body.sampling_params
        sampling = body.engine_sampling_params()
        sampling.lora_name = adapter
        obj = GenerateReqInput(rid, body.prompts, sampling, n=sp.n, params_path="sampling_params.")
        handle = await submit(request, self.ctx.manager, obj)
        if body.stream:
            return await sse_response(request, handle, self._chunks(handle, body))
        results = await collect(request, handle)
        outs = [self._response(handle, r, body).model_dump() for r in results]
        return JSONResponse(outs if body.is_batch or sp.n > 1 else outs[0])

    async def _chunks(self, handle: RequestHandle, body: NativeGenerateRequest) -> AsyncIterator[str]:
        results = [ChoiceResult(s.index) for s in handle.states]
        async for delta in handle:
            result = results[delta.index]
            result.add(delta)
            if delta.token_ids or delta.text or delta.finish_reason:
                yield self._response(handle, result, body).model_dump_json()

    @staticmethod
    def _response(
        handle: RequestHandle, r: ChoiceResult, body: NativeGenerateRequest
    ) -> NativeGenerateResponse:
        """One choice's answer; with ``return_logprob``, ``meta_info`` has the output tokens' logprobs
        and, when ``top_logprobs_num`` > 0, their top ones (SGLang's: null otherwise)."""
        state = handle.states[r.index]
        finish = FinishReasonInfo(type=r.finish_reason, matched=r.matched_stop) if r.finish_reason else None
        meta = MetaInfo(  # the rid, or one per choice (SGLang's ids); the backends' rids are tagged
            id=handle.rid if len(handle.states) == 1 else f"{handle.rid}-{r.index}",
            finish_reason=finish,
            prompt_tokens=len(state.input_ids),
            completion_tokens=r.completion_tokens,
            cached_tokens=r.cached_tokens,
            e2e_latency=time.monotonic() - handle.arrival,
        )
        if body.return_logprob:
            meta.output_token_logprobs = [(lp.logprob, lp.token_id, None) for lp in r.logprobs]
        if body.return_logprob and body.top_logprobs_num:
            meta.output_top_logprobs = [_top(lp) for lp in r.logprobs]
        if r.prompt_logprobs:  # asked for (sampling_params.prompt_logprobs): prompt tokens 1..
            meta.input_token_logprobs = [(None, state.input_ids[0], None)]
            meta.input_token_logprobs += [(lp.logprob, lp.token_id, None) for lp in r.prompt_logprobs]
            meta.input_top_logprobs = [None] + [_top(lp) for lp in r.prompt_logprobs]
        return NativeGenerateResponse(text=r.text, output_ids=r.token_ids, meta_info=meta, index=r.index)

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.ctx.check_model(body.model, required=False)
        if body.messages is not None:
            prompt = ChatPrompt([m.as_dict() for m in body.messages], body.add_generation_prompt)
            add_special = False
        else:
            prompt, add_special = body.prompt, body.add_special_tokens
        manager = self.ctx.manager
        (tokenized,) = await manager.tokenize([prompt], add_special)
        info = await manager.model_info()
        ids = tokenized.input_ids
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=info.context_length)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """Raises ``GatewayError`` 400 (param ``tokens``) for an id outside the vocabulary."""
        self.ctx.check_model(body.model, required=False)
        vocab = (await self.ctx.manager.model_info()).vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None) if vocab else None
        if bad is not None:
            raise invalid_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(
            prompt=await self.ctx.manager.detokenize(body.tokens, body.skip_special_tokens)
        )


def _top(lp: TokenLogprob) -> list[tuple[float, int, None]]:
    return [(t.logprob, t.token_id, None) for t in lp.top]
