"""What a request must satisfy before any of its sub-requests is sent (the gateway's admission).

The pending limit counted in sub-requests (prompts × n), the vocabulary bounds of ``top_k`` and of
stop and bias token ids (``pdserve.sampling.bounds``: the request models bound everything the
vocabulary does not decide), each prompt's ids (and their number, where the request asks for
prompt logprobs), and the context length, which also sets the default ``max_new_tokens``. Every
failure is a ``GatewayError`` naming the field.

The pending limit: ``--max-pending-requests N`` sets it; 0 means none; unset (the default) sizes it
from the KV pools of the decode workers, as each reports in ``GetLoad``::

    limit = sum over healthy decode workers of (request_capacity + max_queued_requests)
    request_capacity = min(--max-running-requests, kv_pages // pages of a minimal request)
    max_queued_requests = --max-queued-requests (default 2 * request_capacity)

(``pdserve.scheduler.overload``): what the decode pool can run at once plus what its waiting
queues may hold, in scheduler requests, which is what a sub-request becomes. A request beyond the
limit gets 429 with ``Retry-After`` (one that passes it while no decode worker is healthy gets 503
with ``Retry-After`` from the router, once it is validated). Until the decode workers have reported
(the first health round, at start), and when one reports an unbounded queue, there is no limit here:
the schedulers' own queue bounds still refuse (RESOURCE_EXHAUSTED, 429). The limit is per replica:
N replicas in front of one pool may take N times the pool's capacity, and the schedulers then refuse
the excess. A request's sub-requests arrive at the schedulers together, before any is admitted, so
one with more of them than the decode workers' waiting queues hold together can never be served
either: a 400, whatever the limit.
"""

from __future__ import annotations

from pdserve.sampling.bounds import (
    MAX_PROMPT_LOGPROB_POSITIONS,
    MAX_PROMPT_LOGPROB_TOKENS,
    BoundError,
    check_vocab_fields,
)
from pdserve.services.gateway.errors import (
    GatewayError,
    context_length_exceeded,
    invalid_request,
    retry_after,
)
from pdserve.services.gateway.io_struct import GenerateReqInput, SamplingParams
from pdserve.services.gateway.routing.workers import WorkerPool


def pending_limit(configured: int | None, decode: WorkerPool) -> int | None:
    """The pending limit in sub-requests now: ``configured`` when given (0 = None: no limit), else
    sized from the healthy decode workers' reports (None until each has reported a bounded capacity)."""
    if configured is not None:
        return configured or None
    capacities = [w.capacity for w in decode.healthy()]
    if not capacities or any(not c for c in capacities):  # unreported (None) or unbounded (0)
        return None
    return sum(capacities)


def queue_room(decode: WorkerPool) -> int | None:
    """Sub-requests the healthy decode workers' waiting queues hold together (None until each has
    reported a bounded queue)."""
    bounds = [w.max_queued for w in decode.healthy()]
    if not bounds or any(not b for b in bounds):
        return None
    return sum(bounds)


def check_pending(obj: GenerateReqInput, pending: int, configured: int | None, decode: WorkerPool) -> None:
    """Count ``obj``'s sub-requests against the pending limit with ``pending`` already in flight.

    Raises:
        GatewayError: 400 (naming ``input`` for embeddings, else ``n``) when they alone exceed the
            limit or the decode workers' waiting queues (``queue_room``), so it can never be served;
            429 with ``Retry-After`` when they would take the replica past the limit.
    """
    limit = pending_limit(configured, decode)
    choices = obj.num_choices
    most = min((x for x in (limit, queue_room(decode)) if x is not None), default=None)
    if most is not None and choices > most:
        embed = obj.sampling_params.embed
        what = "inputs" if embed else "sub-requests (prompts × n)"
        raise invalid_request(
            f"the request fans out into {choices} {what}; this server takes at most {most} at once",
            param="input" if embed else obj.params_path + "n",
        )
    if limit is not None and pending + choices > limit:
        raise GatewayError(
            429,
            f"the server is overloaded: {pending} sub-requests in flight (limit {limit}); retry later",
            code="too_many_requests",
            headers=retry_after(),
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


def check_ids(input_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    """400 naming ``param`` for an empty prompt, a negative token id, or one at or above
    ``vocab_size`` (0 = unknown)."""
    if not input_ids:
        raise invalid_request("the prompt is empty (no tokens)", param=param)
    low, high = min(input_ids), max(input_ids)
    bad = low if low < 0 else high
    if bad < 0 or (vocab_size and bad >= vocab_size):
        vocab = f"[0, {vocab_size})" if vocab_size else "(token ids are never negative)"
        raise invalid_request(f"token id {bad} is outside the vocabulary {vocab}", param=param)


def check_prompt_logprobs(obj: GenerateReqInput, prompt_len: int, param: str) -> None:
    """400 naming ``param`` when the request asks for prompt logprobs of a prompt over
    ``MAX_PROMPT_LOGPROB_TOKENS`` tokens (each position returns up to 21 logprobs)."""
    if obj.sampling_params.prompt_logprobs is not None and prompt_len > MAX_PROMPT_LOGPROB_TOKENS:
        raise invalid_request(
            f"prompt logprobs are returned for prompts of at most {MAX_PROMPT_LOGPROB_TOKENS} tokens; "
            f"this prompt has {prompt_len}",
            param=param,
        )


def check_prompt_logprob_positions(obj: GenerateReqInput, prompt_lens: list[int]) -> None:
    """400 naming ``n`` when the request's prompt logprobs would fill more than
    ``MAX_PROMPT_LOGPROB_POSITIONS`` scored positions in its response: each of a prompt's ``n``
    choices carries that prompt's logprobs (up to 21 entries a position), all built and serialised
    by the gateway, so a 4,096-token prompt with ``n`` 128 would hold the event loop for minutes."""
    if max(prompt_lens, default=0) > MAX_PROMPT_LOGPROB_TOKENS:
        return  # ``check_prompt_logprobs`` names the prompt that is too long
    positions = obj.n * sum(prompt_lens)
    if obj.sampling_params.prompt_logprobs is not None and positions > MAX_PROMPT_LOGPROB_POSITIONS:
        raise invalid_request(
            f"prompt logprobs are returned for at most {MAX_PROMPT_LOGPROB_POSITIONS} prompt tokens "
            f"in all (prompt tokens x n over the prompts, each choice carrying its prompt's); "
            f"this request asks for {positions}",
            param=obj.params_path + "n",
        )


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
        name = "min_new_tokens" if obj.params_path else "min_tokens"  # as the client's API spells it
        raise invalid_request(
            f"{name} ({sp.min_new_tokens}) exceeds the {limit} tokens this prompt can get",
            param=obj.params_path + name,
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
