"""One streamed OpenAI completion, timed chunk by chunk on the client (TTFT, ITL, end-to-end)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import openai

from benchmarks.serving_lib.stats import RequestRecord


@dataclass(frozen=True, slots=True)
class CompletionTarget:
    """Where and how to send completions.

    ``ignore_eos`` goes in ``extra_body`` (an extension that pdserve, vLLM, SGLang and llama.cpp
    accept), so every request generates exactly ``output_tokens`` tokens; so does ``priority``
    (vLLM's and pdserve's, under their priority scheduling policy) when set.
    """

    client: openai.AsyncOpenAI
    model: str
    output_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = True
    priority: int | None = None


async def stream_completion(target: CompletionTarget, prompt: str, prompt_tokens: int) -> RequestRecord:
    """Send ``prompt`` as a streaming ``/v1/completions`` request and time every text chunk.

    Output, prompt and cached prompt token counts come from the final usage chunk
    (``stream_options.include_usage``; ``prompt_tokens_details.cached_tokens``);
    a server that sends none gets its output counted as one token per non-empty chunk and keeps
    ``prompt_tokens``. Errors do not raise: they end up in ``RequestRecord.error``. A completion that
    finished with tokens that all decode to no text (a random-weight model can repeat a special token,
    which is not shown) is served, without a TTFT.

    ITL is per output token, as SGLang's ``bench_serving`` times it: a chunk's gap since the last text
    chunk is spread evenly over the tokens it brings (its running usage,
    ``stream_options.continuous_usage_stats``, tells how many; one where the server sends none, as
    llama.cpp's one-token chunks), so a speculative step's accepted tokens count as several short
    gaps, not one long one.
    """
    record = RequestRecord(prompt_tokens=prompt_tokens, start=time.perf_counter())
    streamed = 0  # output tokens the text chunks so far brought (one a chunk without usage)
    finish = None
    last = record.start
    try:
        stream = await target.client.completions.create(
            model=target.model,
            prompt=prompt,
            max_tokens=target.output_tokens,
            temperature=target.temperature,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": target.ignore_eos}
            | ({} if target.priority is None else {"priority": target.priority}),
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                # tokens this chunk brings (several after a speculative step), from its running usage
                # where the server sends one (vLLM's continuous_usage_stats), else one
                counted = chunk.usage.completion_tokens if chunk.usage is not None else streamed + 1
                new_tokens = max(1, counted - streamed)
                if record.ttft is None:
                    record.ttft = now - record.start
                else:
                    record.itl.extend([(now - last) / new_tokens] * new_tokens)
                last = now
                streamed += new_tokens
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                record.output_tokens = chunk.usage.completion_tokens
                record.prompt_tokens = chunk.usage.prompt_tokens or prompt_tokens
                details = chunk.usage.prompt_tokens_details
                record.cached_tokens = (details.cached_tokens or 0) if details else 0
    except (openai.OpenAIError, httpx.HTTPError) as e:
        record.error = f"{type(e).__name__}: {e}"[:300]
    record.end = time.perf_counter()
    if record.error is None and record.ttft is None and not (finish and record.output_tokens):
        record.error = f"no text was streamed ({record.output_tokens} tokens, finish_reason {finish})"
    if not record.output_tokens:
        record.output_tokens = streamed
    return record
