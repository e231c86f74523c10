"""What a request must satisfy before any of its sub-requests is sent (the gateway's admission).

The pending limit counted in sub-requests (prompts × n), the vocabulary bounds of ``top_k`` and of
stop and bias token ids (``pdserve.sampling.bounds``: the request models bound everything the
vocabulary does not decide), each prompt's ids, and the context length, which also sets the default
``max_new_tokens``. Every failure is a ``GatewayError`` naming the field.
"""

from __future__ import annotations

from pdserve.sampling.bounds import BoundError, check_vocab_fields
from pdserve.services.gateway.errors import GatewayError, context_length_exceeded, invalid_request
from pdserve.services.gateway.io_struct import GenerateReqInput, SamplingParams


def check_pending(obj: GenerateReqInput, pending: int, limit: int) -> None:
    """Count ``obj``'s sub-requests against ``limit`` (0 = none) with ``pending`` already in flight.

    Raises:
        GatewayError: 400 (naming ``n``) when they alone exceed the limit, so it can never be served;
            429 with ``Retry-After`` when they would take the replica past it.
    """
    choices = obj.num_choices
    if not limit:
        return
    if choices > limit:
        raise invalid_request(
            f"the request fans out into {choices} sub-requests (prompts × n); this server takes at "
            f"most {limit} at once",
            param=obj.params_path + "n",
        )
    if pending + choices > limit:
        raise GatewayError(
            429,
            f"too many requests in flight ({pending} sub-requests of {limit}); retry later",
            code="too_many_requests",
            headers={"Retry-After": "1"},
        )


def check_sampling(obj: GenerateReqInput, vocab_size: int) -> None:
    """400 naming the field for ``top_k`` above the vocabulary or a stop / bias token id outside it
    (``vocab_size`` 0 = unknown); a UnicodeEncodeError (a 400) for a stop string that is not UTF-8."""
    sp = obj.sampling_params
    for stop in sp.stop:
        stop.encode()  # now, not after routing: protobuf cannot carry it
    if not vocab_size:
        return
    try:
        check_vocab_fields(sp.top_k, sp.stop_token_ids, sp.logit_bias, vocab_size)
    except BoundError as e:
        raise invalid_request(obj.params_path + str(e), param=obj.params_path + e.field) from None


def check_ids(input_ids: list[int], vocab_size: int) -> None:
    """400 for an empty prompt, a negative token id, or one at or above ``vocab_size`` (0 = unknown)."""
    if not input_ids:
        raise invalid_request("the prompt is empty (no tokens)", param="prompt")
    low, high = min(input_ids), max(input_ids)
    bad = low if low < 0 else high
    if bad < 0 or (vocab_size and bad >= vocab_size):
        vocab = f"[0, {vocab_size})" if vocab_size else "(token ids are never negative)"
        raise invalid_request(f"token id {bad} is outside the vocabulary {vocab}", param="prompt")


def max_new_tokens(
    obj: GenerateReqInput, prompt_len: int, context_length: int, default_max: int, param: str
) -> int:
    """The request's ``max_new_tokens``, or the context left (capped by ``default_max``).

    Raises:
        GatewayError: ``context_length_exceeded`` (400, naming ``param``: "messages" or "prompt")
            when the prompt, or the prompt plus the request's ``max_new_tokens``, does not fit in the
            context; 400 naming ``min_tokens`` when that is more than the tokens it can get.
    """
    sp: SamplingParams = obj.sampling_params
    limit = _max_new_tokens(prompt_len, sp.max_new_tokens, context_length, default_max, param)
    if (sp.min_new_tokens or 0) > limit:
        raise invalid_request(
            f"min_tokens ({sp.min_new_tokens}) exceeds the {limit} tokens this prompt can get",
            param=obj.params_path + ("min_new_tokens" if obj.params_path else "min_tokens"),
        )
    return limit


def _max_new_tokens(
    prompt_len: int, requested: int | None, context_length: int, default_max: int, param: str
) -> int:
    if context_length <= 0:  # the tokenizer does not know the context length
        return requested or default_max
    if prompt_len >= context_length:
        raise context_length_exceeded(
            f"This model's maximum context length is {context_length} tokens, but the prompt has "
            f"{prompt_len} tokens. Please shorten the prompt.",
            param,
        )
    if requested is None:
        return min(context_length - prompt_len, default_max)
    if prompt_len + requested > context_length:
        raise context_length_exceeded(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            f"completion). Please reduce the length of the prompt or the completion.",
            param,
        )
    return requested
