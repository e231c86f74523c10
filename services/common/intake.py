"""How a scheduler RPC queues its request: at the loop's next step, refused with a gRPC status the
gateway maps (INVALID_ARGUMENT a 400, NOT_FOUND a 404, RESOURCE_EXHAUSTED a 429, ALREADY_EXISTS a
409), and, for a constrained request, held until its grammar compiled so that a bad grammar fails the
call itself."""

from __future__ import annotations

import grpc

from pdserve.scheduler.overload import QueueFull
from pdserve.scheduler.req import Req
from pdserve.scheduler.table import DuplicateRid, UnknownAdapter
from pdserve.services.common.grammar_wait import grammar_error, tp_refusal
from pdserve.services.common.scheduler_loop import SchedulerLoop


def refusal_status(error: ValueError | QueueFull) -> grpc.StatusCode:
    """The status for a request ``Scheduler.add_request`` refused: ALREADY_EXISTS for a rid the
    scheduler holds (``DuplicateRid``), NOT_FOUND (the gateway's 404 ``model_not_found``) for a
    LoRA adapter it does not hold (``UnknownAdapter``: unloaded while the request travelled),
    RESOURCE_EXHAUSTED (the gateway's 429) for a full queue, INVALID_ARGUMENT for any other
    ValueError."""
    if isinstance(error, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, UnknownAdapter):
        return grpc.StatusCode.NOT_FOUND
    return (
        grpc.StatusCode.ALREADY_EXISTS
        if isinstance(error, DuplicateRid)
        else grpc.StatusCode.INVALID_ARGUMENT
    )


async def check_tp(req: Req, loop: SchedulerLoop, context: grpc.aio.ServicerContext) -> None:
    """Refuse (INVALID_ARGUMENT) a request this scheduler's TP group cannot run (``tp_refusal``)."""
    refusal = tp_refusal(req.sampling_params, loop.tp)
    if refusal:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)


async def queue_request(req: Req, loop: SchedulerLoop, context: grpc.aio.ServicerContext) -> int:
    """Queue ``req`` at ``loop``'s next step and, if it is constrained, wait for its grammar; returns
    its place in the waiting queue. Aborts the call (``context.abort`` raises) when the scheduler
    refuses it or its grammar fails (``grammar_wait.grammar_error``)."""
    try:
        position = await loop.add(req)
    except (ValueError, QueueFull) as e:
        await context.abort(refusal_status(e), str(e))
    error = await grammar_error(loop.scheduler, req)
    loop.wake()  # a compiled grammar moves its request on at the next step
    if error:
        await context.abort(*error)
    return position
