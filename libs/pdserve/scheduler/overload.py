"""Overload limits of one scheduler: how many requests it can run, how many may wait, and for how long.

A scheduler refuses work it cannot start soon instead of queueing it for ever (SGLang's
``--max-queued-requests``; vLLM bounds the running batch with ``--max-num-seqs``):

- **request capacity** ``R = min(max_running_requests, usable_pages // pages_for(1 + new_token_reserve))``:
  the requests that can run at once, bounded by the running batch and by the pool (each admitted
  request holds at least its first token plus the ``new_token_reserve`` tokens reserved for its next
  tokens).
- **waiting queue bound** ``Q`` (``--max-queued-requests``, default ``QUEUE_FACTOR * R``; 0 = none): a
  request that arrives while ``Q`` requests wait is refused (``QueueFull``; RESOURCE_EXHAUSTED on the
  wire, 429 at the gateway).
- **queue-time limit** (``--max-queue-time``, default ``DEFAULT_MAX_QUEUE_TIME_S``; 0 = none): a request
  that has waited that long since it arrived, never admitted, fails as *retryable* (503 with
  ``Retry-After`` at the gateway) instead of waiting on. Requests already started (retracted ones
  back in the queue) are not timed out.

The gateway's default pending limit is the sum of ``R + Q`` over its healthy decode workers, which
report both in ``GetLoad``.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.scheduler.req import Req

QUEUE_FACTOR = 2
DEFAULT_MAX_QUEUE_TIME_S = 60.0


class QueueFull(RuntimeError):
    """The scheduler's waiting queue is at its bound: the request is refused, nothing was queued."""


def request_capacity(max_running_requests: int, usable_pages: int, pages_per_min_request: int) -> int:
    """Requests that can run at once: the running batch size, bounded by the KV pool (at least 1)."""
    return max(1, min(max_running_requests, usable_pages // max(1, pages_per_min_request)))


def queue_bound(max_queued_requests: int | None, capacity: int) -> int:
    """``max_queued_requests`` when given (0 = no bound), else ``QUEUE_FACTOR * capacity``."""
    if max_queued_requests is None:
        return QUEUE_FACTOR * capacity
    return max_queued_requests


def check_queue_room(num_waiting: int, bound: int) -> None:
    """Raises ``QueueFull`` when ``num_waiting`` requests already wait and ``bound`` (> 0) allows no more."""
    if bound and num_waiting >= bound:
        raise QueueFull(
            f"the server is overloaded: {num_waiting} requests are already waiting on this scheduler "
            f"(max-queued-requests {bound}); retry later"
        )


def overdue(waiting: Iterable[Req], now: float, max_queue_time: float) -> list[tuple[Req, str]]:
    """Waiting requests, never started, that arrived more than ``max_queue_time`` s before ``now``
    (``time.time()``), each with the error it fails with; none when ``max_queue_time`` is 0."""
    if not max_queue_time:
        return []
    return [
        (
            req,
            f"the server is overloaded: the request waited {now - req.arrival_time:.1f} s in the queue "
            f"(max-queue-time {max_queue_time:g} s); retry later",
        )
        for req in waiting
        if not req.output_ids and now - req.arrival_time > max_queue_time
    ]
