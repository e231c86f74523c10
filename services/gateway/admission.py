"""How many requests one gateway replica takes in flight before it refuses new ones.

``--max-pending-requests N`` sets the limit; 0 means none; unset (the default) sizes it from the KV
pools of the decode workers, as each reports in ``GetLoad``::

    limit = sum over healthy decode workers of (request_capacity + max_queued_requests)
    request_capacity = min(--max-running-requests, kv_pages // pages of a minimal request)
    max_queued_requests = --max-queued-requests (default 2 * request_capacity)

(``pdserve.scheduler.overload``): what the decode pool can run at once plus what its waiting
queues may hold. A request beyond the limit gets 429 with ``Retry-After`` (one that passes it while
no decode worker is healthy gets 503 with ``Retry-After`` from the router, once it is validated).
Until the decode workers have reported (the first health round, at start), and when one reports an
unbounded queue, there is no limit here: the schedulers' own queue bounds still refuse
(RESOURCE_EXHAUSTED, 429). The limit is per replica: N replicas in front
of one pool may take N times the pool's capacity, and the schedulers then refuse the excess.
"""

from __future__ import annotations

from pdserve.services.gateway.errors import GatewayError, retry_after
from pdserve.services.gateway.router import WorkerPool


def pending_limit(configured: int | None, decode: WorkerPool) -> int | None:
    """The pending limit now: ``configured`` when given (0 = None: no limit), else sized from the
    healthy decode workers' reports (None until each has reported a bounded capacity)."""
    if configured is not None:
        return configured or None
    capacities = [w.capacity for w in decode.healthy()]
    if not capacities or any(not c for c in capacities):  # unreported (None) or unbounded (0)
        return None
    return sum(capacities)


def check_pending(pending: int, configured: int | None, decode: WorkerPool) -> None:
    """Refuse one more request when ``pending`` are in flight.

    Raises:
        GatewayError: 429 (``Retry-After``) when ``pending`` has reached the limit.
    """
    limit = pending_limit(configured, decode)
    if limit is not None and pending >= limit:
        raise GatewayError(
            429,
            f"the server is overloaded: {pending} requests in flight (limit {limit}); retry later",
            code="too_many_requests",
            headers=retry_after(),
        )
