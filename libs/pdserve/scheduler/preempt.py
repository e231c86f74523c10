"""Preemption by priority (vLLM's ``--scheduling-policy priority``), in the roles that decode.

Before each step, while the first waiting request in the priority order cannot be admitted (the
running batch is full, or the pool cannot give it its pages and reserve, its radix-cache match
counted), the running request the policy ranks last is retracted if its priority is strictly lower
(a higher value) than the waiting one's. Retraction is the KV-shortage path's
(``DecodeManager.retract``): its computed KV goes to the radix cache and it waits again with the
tokens it generated, so nothing is lost; it is re-admitted once no request of higher priority waits
for room. Requests of equal priority never preempt each other.

A prefill worker does not preempt: its requests leave it once their prompt is computed, and its
queue is ordered by priority all the same.
"""

from __future__ import annotations

from pdserve.scheduler.admission import Admission
from pdserve.scheduler.decode import DecodeManager
from pdserve.scheduler.policy import SchedulePolicy
from pdserve.scheduler.req import ReqState


class Preemption:
    """Retracts lower-priority running requests for the waiting request of highest priority.

    Args:
        admission: the stage's admission (its queue, and whether a request fits now).
        decode: the running requests, and their retraction.
        policy: the priority policy (which running request goes first).
    """

    def __init__(self, admission: Admission, decode: DecodeManager, policy: SchedulePolicy) -> None:
        self.admission, self.decode, self.policy = admission, decode, policy

    def run(self, in_flight: bool) -> bool:
        """Retract what the first waiting request needs retracted (see the module docstring).

        Args:
            in_flight: a scheduled batch is not processed yet: its requests' KV is being read.

        Returns:
            False when a retraction is due while a batch is in flight (nothing was retracted: the
            caller processes that batch and schedules again); True otherwise.
        """
        waiting = self.admission.queue.in_order()
        if not waiting:
            return True
        head = waiting[0]
        while True:
            order = self.policy.retraction_order(self.decode.running)
            victims = [r for r in order if r.state is ReqState.RUNNING and not r.to_abort]
            if not victims or victims[-1].sampling_params.priority <= head.sampling_params.priority:
                return True  # (checked first: it spares the radix match of ``blocked``)
            if not self.admission.blocked(head):
                return True
            if in_flight:
                return False
            self.decode.retract(victims[-1], f"for {head.rid} (priority {head.sampling_params.priority})")
