"""Hold a scheduler RPC until the request's grammar compiled, so a bad grammar fails the call."""

from __future__ import annotations

import asyncio

from pdserve.scheduler.scheduler import Scheduler


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
