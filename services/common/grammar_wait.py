"""Hold a scheduler RPC until the request's grammar compiled, so a bad grammar fails the call; refuse
constrained requests where grammars cannot run (a tensor-parallel scheduler)."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.constrained.compile import CompilerUnavailable
from pdserve.distributed import TpGroup
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.req import FinishReason, Req
from pdserve.scheduler.scheduler import Scheduler

GRAMMAR_UNDER_TP = "structured outputs are not supported with --tp-size > 1 yet"


def tp_refusal(params: SamplingParams, tp: TpGroup) -> str:
    """Why a request cannot run on a scheduler of ``tp.size`` ranks: "" unless it is constrained
    (response_format, structured_outputs, a required or named tool call, ...) and ``tp.size`` > 1.

    A grammar compiles in each rank's process on its own thread, so the ranks could disagree about
    the step at which a constrained request is ready, and their schedulers would diverge; until the
    ready point is an input rank 0 decides at the step seam, such requests are refused (rank 0's
    handler answers INVALID_ARGUMENT, the gateway's 400).
    """
    return GRAMMAR_UNDER_TP if tp.size > 1 and params.grammar is not None else ""


async def grammar_error(scheduler: Scheduler, req: Req) -> tuple[grpc.StatusCode, str] | None:
    """Wait (at most the scheduler's grammar compile timeout) for ``req``'s grammar.

    The request was handed to the scheduler, whose grammar queue fails it the same way at a step;
    waiting here lets the caller answer with an error instead of acknowledging a request that will
    only fail. A step may have failed it already (a cached failure is known at once): that error.

    Returns:
        None when the grammar compiled (or the request has none), else the call's status and why:
        INVALID_ARGUMENT (the gateway's 400) for a bad grammar or one whose own compile ran past the
        timeout, RESOURCE_EXHAUSTED (429 with Retry-After, as a full queue) when it only waited behind
        other requests' compiles or the compiler process was killed from outside meanwhile.
    """
    future = scheduler.grammar_future(req.rid)
    if future is not None:
        waiter = asyncio.wrap_future(future)  # (asyncio.wait leaves it running when the time is up)
        waiter.add_done_callback(_retrieve)  # a failure after we stopped waiting is the queue's to report
        await asyncio.wait({waiter}, timeout=scheduler.config.grammar_compile_timeout)
        if waiter.done():
            error = waiter.exception()  # GrammarError, CompilerUnavailable, the compile thread's own
            if error is None:
                return None
            return _status(str(error) or type(error).__name__, isinstance(error, CompilerUnavailable))
        if req.grammar is None and req.finish_reason is None:  # still in the grammar queue
            return _status(*scheduler.grammar_timeout_reason(req))
    # unconstrained, or a step took it out of the grammar queue: ready, or failed with its error
    failed = req.sampling_params.grammar is not None and req.finish_reason == FinishReason.ERROR
    return _status(req.error, req.retryable) if failed and not req.output_ids else None


def _retrieve(waiter: asyncio.Future) -> None:
    """Mark ``waiter``'s exception as seen (asyncio logs a failed future nobody looked at)."""
    if not waiter.cancelled():
        waiter.exception()


def _status(reason: str, retryable: bool) -> tuple[grpc.StatusCode, str]:
    return (grpc.StatusCode.RESOURCE_EXHAUSTED if retryable else grpc.StatusCode.INVALID_ARGUMENT), reason
