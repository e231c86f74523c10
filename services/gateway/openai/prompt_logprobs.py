"""Prompt logprobs in the two shapes clients read them in.

- OpenAI's legacy completions ``logprobs`` of an echoed prompt (``echo`` with ``logprobs``): one
  entry per prompt token, the first with null ``token_logprobs`` and ``top_logprobs``; what
  lm-evaluation-harness's ``local-completions`` model sends and parses to score a model.
- vLLM's ``prompt_logprobs``: null for the first prompt token, then per position a map of token id
  (as a string) to ``{logprob, rank, decoded_token}`` holding the prompt token and the top ones.

The runtime computes them during prefill (``pdserve.sampling.prompt_logprobs``) and sends them with a
choice's first output, scoring prompt tokens 1.. in order.
"""

from __future__ import annotations

from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.io_struct import TokenLogprob
from pdserve.services.gateway.openai.legacy_logprobs import TextOffsets, append_token
from pdserve.services.gateway.openai.protocol_responses import (
    CompletionLogprobs,
    PromptLogprobEntry,
    PromptLogprobs,
)
from pdserve.services.gateway.requests.token_pieces import TokenPieces


def _check(prompt_ids: list[int], scored: list[TokenLogprob]) -> None:
    """Raises ``GatewayError`` 500 unless ``scored`` scores prompt tokens 1.. exactly."""
    if [lp.token_id for lp in scored] != prompt_ids[1:]:
        raise GatewayError(500, "the runtime returned prompt logprobs that do not match the prompt")


async def echo_logprobs(
    pieces: TokenPieces, prompt_ids: list[int], scored: list[TokenLogprob], top: int, offsets: TextOffsets
) -> CompletionLogprobs:
    """The legacy logprobs of an echoed prompt (``top`` alternatives per token, ``legacy_logprobs``),
    its offsets taken from ``offsets`` (a new choice's), which then stand after the prompt."""
    _check(prompt_ids, scored)
    texts = await pieces.get(prompt_ids + [t.token_id for lp in scored for t in lp.top[:top]])
    out = CompletionLogprobs()
    append_token(out, texts, offsets, prompt_ids[0], None, None)
    for lp in scored:
        append_token(out, texts, offsets, lp.token_id, lp.logprob, lp.top[:top])
    return out


async def vllm_prompt_logprobs(
    pieces: TokenPieces, prompt_ids: list[int], scored: list[TokenLogprob], top: int
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs`` of ``prompt_ids`` with ``top`` alternatives per position."""
    _check(prompt_ids, scored)
    texts = await pieces.get(prompt_ids + [t.token_id for lp in scored for t in lp.top[:top]])
    out: PromptLogprobs = [None]
    for lp in scored:
        ranks = {t.token_id: rank for rank, t in enumerate(lp.top, 1)}
        position = {
            str(lp.token_id): PromptLogprobEntry(
                logprob=lp.logprob,
                rank=ranks.get(lp.token_id, lp.rank or None),  # (its place among the top ones first)
                decoded_token=texts[lp.token_id].text,
            )
        }
        for rank, t in enumerate(lp.top[:top], 1):
            position[str(t.token_id)] = PromptLogprobEntry(
                logprob=t.logprob, rank=rank, decoded_token=texts[t.token_id].text
            )
        out.append(position)
    return out
