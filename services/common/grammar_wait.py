"""Hold a scheduler RPC until the request's grammar compiled, so a bad grammar fails the call; refuse
constrained requests where grammars cannot run (a tensor-parallel scheduler)."""

from __future__ import annotations

import asyncio

from pdserve.distributed import TpGroup
from pdserve.sampling.sampling_params import SamplingParams
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


async def grammar_error(scheduler: Scheduler, rid: str) -> str:
    """Wait (at most the scheduler's grammar compile timeout) for ``rid``'s grammar.

    The request already sits in the scheduler's grammar queue, which fails it the same way on its
    next step; waiting here lets the caller answer INVALID_ARGUMENT (the gateway's 400) instead of
    acknowledging a request that will only fail.

    Returns:
        "" when the grammar compiled (or the request has none), else why it cannot be used.
    """
    future = scheduler.grammar_future(rid)
    if future is None:
        return ""
    timeout = scheduler.config.grammar_compile_timeout
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
    except TimeoutError:
        return f"grammar compilation took longer than {timeout:g} s"
    except Exception as e:  # GrammarError (a bad grammar), or the compile thread's own failure
        return str(e) or type(e).__name__
    return ""
