"""The waiting queue: requests not admitted yet, in the order the schedule policy gives them.

A constrained request first waits in the grammar queue until its grammar compiled. The queue is
bounded and its requests time out (``overload``); a retracted request goes back to its front.
"""

from __future__ import annotations

import logging

from pdserve.scheduler.grammar_queue import GrammarQueue
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.scheduler.overload import QueueFull, check_queue_room, overdue
from pdserve.scheduler.policy import SchedulePolicy
from pdserve.scheduler.req import Req

logger = logging.getLogger(__name__)


class WaitingQueue:
    """Requests waiting for admission, and those whose grammar is still compiling.

    Args:
        policy: orders the queue for admission.
        grammars: the grammar queue.
        bound: at most this many requests wait (with the grammar queue); 0 = no bound.
        max_queue_time: seconds a request may wait never admitted; 0 = no limit (a prefill worker:
            its decode worker owns the request and its deadline).
        metrics: counts refusals.
    """

    def __init__(
        self,
        policy: SchedulePolicy,
        grammars: GrammarQueue,
        bound: int,
        max_queue_time: float,
        metrics: SchedulerMetrics,
    ) -> None:
        self.policy = policy
        self.grammars = grammars
        self.bound = bound
        self.max_queue_time = max_queue_time
        self.metrics = metrics
        self.waiting: list[Req] = []

    def __len__(self) -> int:
        """Requests waiting, the grammar queue's included."""
        return len(self.waiting) + len(self.grammars)

    def check_room(self) -> None:
        """Raises ``QueueFull`` when the queue is at its bound (and counts the refusal)."""
        try:
            check_queue_room(len(self), self.bound)
        except QueueFull:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise

    def add(self, req: Req) -> None:
        """Queue ``req``; a constrained one waits for its grammar first.

        Raises:
            ValueError: ``req`` is constrained and there is no grammar backend.
        """
        if req.sampling_params.grammar is not None:
            self.grammars.add(req)
        else:
            self.waiting.append(req)

    def requeue(self, req: Req) -> None:
        """Put a retracted ``req`` back at the front."""
        self.waiting.insert(0, req)

    def remove(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        self.grammars.remove(req)

    def in_order(self) -> list[Req]:
        """The waiting requests in admission order (a copy: admitting one removes it)."""
        self.policy.order(self.waiting)
        return list(self.waiting)

    def take_compiled(self) -> list[tuple[Req, str]]:
        """Requests whose grammar compiled join the queue; those whose compile failed are returned
        with the reason, to be ended."""
        ready, failed = self.grammars.pop_done()
        self.waiting += ready
        return failed

    def take_overdue(self, now: float) -> list[tuple[Req, str]]:
        """Take out every request that waited past ``max_queue_time`` without being admitted, each with
        the (retryable) error it fails with."""
        late = overdue(self.waiting, now, self.max_queue_time)
        for req, error in late:
            logger.warning("%s: %s", req.rid, error)
            self.waiting.remove(req)
            self.metrics.rejected.labels(reason="queue_time").inc()
        return late
