"""The KV-event calls both scheduler roles serve (``SubscribeKVEvents``, ``FlushCache``), as functions
their servicers delegate to.

The subscription is made, and its snapshot built, by the handler on the scheduler loop's own thread
(the gRPC server and the loop share one asyncio loop) between two of the loop's awaits, so the
snapshot is the radix cache as of the last batch sent; from then on the batches reach the stream
through its bounded queue (``KVEventPublisher``), never by reading the tree.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.mem_cache.kv_events import KVEventsOverflow
from pdserve.scheduler.scheduler import Scheduler
from pdserve.services.common import convert
from pdserve.services.common.scheduler_loop import SchedulerLoop


async def subscribe_kv_events(
    loop: SchedulerLoop, request: Any, context: grpc.aio.ServicerContext
) -> AsyncIterator:
    """Stream ``loop``'s KV event batches (``KVEventBatch`` messages) from ``request.from_seq``
    (a replay, only of this process's own batches: ``request.incarnation`` must be this process's)
    or from a snapshot; a consumer cut off for falling behind gets RESOURCE_EXHAUSTED."""
    replay = request.HasField("from_seq") and request.incarnation == convert.INCARNATION
    from_seq = request.from_seq if replay else None
    subscription = loop.kv_events.subscribe(from_seq)
    try:
        async for batch in subscription:
            yield convert.kv_event_batch_to_pb(batch)
    except KVEventsOverflow as e:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    finally:
        subscription.close()


async def flush_cache(loop: SchedulerLoop) -> Any:
    """``Scheduler.flush_cache`` at the loop's next input point; the ``FlushCacheResponse``."""
    return convert.flush_cache_response_to_pb(await loop.call(Scheduler.flush_cache))
