"""Who goes first: the waiting queue's admission order, ``fcfs``, ``lpm`` (longest cached prefix
first) or ``priority``, and the running requests' order of retraction when the KV pool runs short.

``lpm`` follows SGLang's cache-aware scheduling (Zheng et al., 2024, §4): requests whose prompt
shares the longest prefix with the radix cache run first, so a shared prefix is reused before it is
evicted. A request that has waited ``starvation_s`` seconds goes first regardless, so lpm never
starves a request without a cached prefix.

``priority`` follows vLLM's ``--scheduling-policy priority``: the queue is ordered by (priority,
arrival), a lower ``SamplingParams.priority`` first; the lowest-priority running request (highest
value, latest admitted among equals) is retracted first, and ``pdserve.scheduler.preempt`` retracts
running requests to admit a waiting one of higher priority. As in vLLM, a low-priority request can
starve while higher-priority ones keep arriving: one never started waits until ``max_queue_time``
ends it (retryable); one retracted keeps its tokens and waits until no higher-priority request
waits for room, or its deadline passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.scheduler.req import Req

POLICIES = ("fcfs", "lpm", "priority")


class SchedulePolicy:
    """Orders the waiting queue (``order``) and the running requests (``retraction_order``).

    Args:
        policy: ``"fcfs"``, ``"lpm"`` or ``"priority"``.
        prefix_len: for lpm, returns the cached prefix length (tokens) of a request's prompt.
        starvation_s: for lpm, seconds after which a request is served in arrival order.
        clock: the current time (the scheduler's clock, so TP ranks agree on who starves).

    Raises:
        ValueError: unknown policy.
    """

    def __init__(
        self,
        policy: str,
        prefix_len: Callable[[Req], int],
        clock: Callable[[], float] = time.time,
        starvation_s: float = 5.0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}; choose one of {POLICIES}")
        self.policy = policy
        self.prefix_len = prefix_len
        self.starvation_s = starvation_s
        self.clock = clock

    def order(self, waiting: list[Req]) -> None:
        # Retracted requests (they already generated tokens) keep their place at the front (of
        # their priority's requests, under the priority policy).
        if self.policy == "priority":
            waiting.sort(key=lambda r: (r.sampling_params.priority, not r.output_ids, r.arrival_time))
            return
        if self.policy == "fcfs" or len(waiting) < 2:
            waiting.sort(key=lambda r: (not r.output_ids, r.arrival_time))
            return
        now = self.clock()

        def key(r: Req) -> tuple:
            starving = now - r.arrival_time > self.starvation_s
            return (
                not r.output_ids,
                not starving,
                -self.prefix_len(r) if not starving else 0,
                r.arrival_time,
            )

        waiting.sort(key=key)

    def retraction_order(self, running: list[Req]) -> list[Req]:
        """``running`` oldest admitted first: the last one still running is retracted first when the
        KV pool cannot give every request a slot. Stable, so requests admitted together (their
        admit times tie) keep the order they run in, and the victim is never one given a slot
        already. Under the priority policy, ordered by priority first (lowest priority last)."""
        if self.policy == "priority":
            return sorted(running, key=lambda r: (r.sampling_params.priority, r.admit_time))
        return sorted(running, key=lambda r: r.admit_time)
