"""The workers of each role as the gateway sees them: address, health, drain state, load, capacity.

``WorkerMonitor`` keeps each ``Worker`` current (probes and ``GetLoad`` reports), ``discovery`` keeps
a DNS-named pool's membership current, and the router's policies pick among ``healthy()`` workers.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.services.gateway.errors import GatewayError, retry_after


@dataclass(slots=True)
class Worker:
    """One backend process as the router sees it.

    ``load`` = max(queued + running requests the worker last reported, requests this gateway has
    in flight there): the report also counts other replicas' requests but lags; the local count is
    current but sees only this replica.
    """

    address: str
    healthy: bool = True
    draining: bool = False  # alive, but its service reports NOT_SERVING: no new requests
    failed_probes: int = 0  # consecutive failed health checks
    reported_load: int = 0
    in_flight: int = 0
    capacity: int | None = None  # requests it takes before refusing, as reported (0 = unbounded)
    max_queued: int | None = None  # its waiting-queue bound, as reported (0 = unbounded)
    incarnation: str = ""  # of its process, as reported
    lora_resident: frozenset[str] = frozenset()  # LoRA adapters in its slots, as reported

    def holds(self, lora_name: str) -> bool:
        """Whether it reported adapter ``lora_name`` in its LoRA slots (False for "", the base)."""
        return bool(lora_name) and lora_name in self.lora_resident

    @property
    def load(self) -> int:
        return max(self.reported_load, self.in_flight)


class WorkerPool:
    """The workers of one role, with round-robin over the healthy ones.

    ``dynamic``: the set changes at run time (``discovery``), so the role counts as configured even
    while it has no worker.
    """

    def __init__(self, role: str, addresses: Sequence[str], dynamic: bool = False) -> None:
        self.role = role
        self.workers = [Worker(a) for a in addresses]
        self.dynamic = dynamic
        self._turn = itertools.count()

    def __bool__(self) -> bool:
        return bool(self.workers) or self.dynamic

    def update(self, addresses: Sequence[str]) -> tuple[list[str], list[Worker]]:
        """Make the pool exactly ``addresses`` (known workers keep their state); returns the
        addresses added and the workers removed."""
        current = {w.address: w for w in self.workers}
        wanted = list(dict.fromkeys(addresses))
        self.workers = [current.get(a) or Worker(a) for a in wanted]
        return [a for a in wanted if a not in current], [w for a, w in current.items() if a not in wanted]

    def healthy(self) -> list[Worker]:
        """The workers that take new requests: healthy and not draining."""
        return [w for w in self.workers if w.healthy and not w.draining]

    def next(self) -> Worker:
        """The next healthy worker in turn (raises like ``available``)."""
        return rotate(self.available(), next(self._turn))[0]

    def available(self) -> list[Worker]:
        """The healthy workers.

        Raises:
            GatewayError: 503 when there is none.
        """
        workers = self.healthy()
        if not workers:
            raise GatewayError(503, f"no healthy {self.role} worker", headers=retry_after())
        return workers


def rotate(workers: list[Worker], turn: int) -> list[Worker]:
    """``workers`` starting at position ``turn`` (mod their count): the order of a round-robin turn."""
    k = turn % len(workers)
    return workers[k:] + workers[:k]
