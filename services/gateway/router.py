"""Pick the decode-scheduler (and prefill-scheduler) of each request.

Policies (``--router-policy``), applied separately to the decode pool and the prefill pool:

- ``round_robin``: the next healthy worker in turn.
- ``least_load``: the healthy worker with the fewest requests, by ``Worker.load``.
- ``cache_aware``: SGLang router's cache-aware policy: the worker whose approximate prefix tree
  (``ApproxPrefixTree``) holds the longest prefix of the prompt, unless that match covers less than
  ``cache_threshold`` of the prompt or the worker's load exceeds the least-loaded worker's by more
  than ``balance_threshold`` requests; then the least-loaded worker.

Unhealthy workers (marked by ``WorkerMonitor``) are skipped until they answer SERVING again.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pdserve.services.gateway.errors import GatewayError, retry_after
from pdserve.services.gateway.prefix_tree import ApproxPrefixTree

PolicyName = Literal["round_robin", "least_load", "cache_aware"]
POLICIES: tuple[PolicyName, ...] = ("round_robin", "least_load", "cache_aware")


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
    incarnation: str = ""  # of its process, as reported

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
        return _rotate(self.available(), next(self._turn))[0]

    def available(self) -> list[Worker]:
        """The healthy workers.

        Raises:
            GatewayError: 503 when there is none.
        """
        workers = self.healthy()
        if not workers:
            raise GatewayError(503, f"no healthy {self.role} worker", headers=retry_after())
        return workers


class Policy(Protocol):
    def select(self, workers: list[Worker], input_ids: Sequence[int]) -> Worker: ...

    def forget(self, worker: Worker) -> None: ...


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def select(self, workers: list[Worker], input_ids: Sequence[int]) -> Worker:
        return _rotate(workers, next(self._turn))[0]

    def forget(self, worker: Worker) -> None:
        pass


class LeastLoadPolicy:
    """Fewest requests first; ties go round-robin so equal workers share the traffic."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def select(self, workers: list[Worker], input_ids: Sequence[int]) -> Worker:
        return min(_rotate(workers, next(self._turn)), key=lambda w: w.load)

    def forget(self, worker: Worker) -> None:
        pass


class CacheAwarePolicy:
    """Longest approximate prefix match, balanced by load (see the module docstring).

    Args:
        cache_threshold: the match must cover at least this fraction of the prompt.
        balance_threshold: the matched worker may carry at most this many requests more than the
            least-loaded one.
        max_tree_tokens: tokens remembered per worker (``ApproxPrefixTree`` bound).
    """

    def __init__(
        self, cache_threshold: float = 0.5, balance_threshold: int = 32, max_tree_tokens: int = 1 << 18
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_threshold = balance_threshold
        self.tree = ApproxPrefixTree(max_tree_tokens)
        self._least_load = LeastLoadPolicy()

    def select(self, workers: list[Worker], input_ids: Sequence[int]) -> Worker:
        least = self._least_load.select(workers, input_ids)
        chosen = least
        matches = self.tree.match(input_ids)
        candidates = [w for w in workers if matches.get(w.address, 0) > 0]
        if candidates:
            best = max(candidates, key=lambda w: (matches[w.address], -w.load))
            covered = matches[best.address] / max(len(input_ids), 1)
            if covered >= self.cache_threshold and best.load - least.load <= self.balance_threshold:
                chosen = best
        self.tree.insert(input_ids, chosen.address)
        return chosen

    def forget(self, worker: Worker) -> None:
        self.tree.remove_tenant(worker.address)


def make_policy(name: PolicyName) -> Policy:
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy()
    if name == "cache_aware":
        return CacheAwarePolicy()
    raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(POLICIES)}")


@dataclass(slots=True)
class Route:
    """Where one sub-request goes; ``release()`` once it ends (idempotent)."""

    decode: Worker
    prefill: Worker | None
    fallback_prefill_addresses: list[str] = field(default_factory=list)  # decode retries on these
    _released: bool = field(default=False, repr=False)

    @property
    def prefill_address(self) -> str:
        return self.prefill.address if self.prefill else ""

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.decode.in_flight -= 1
            if self.prefill:
                self.prefill.in_flight -= 1


class Router:
    """Routes tokenized requests over the decode pool and the (optional) prefill pool.

    With no prefill workers configured, ``Route.prefill`` is None and decode prefills locally.
    """

    def __init__(self, decode: WorkerPool, prefill: WorkerPool, policy: PolicyName) -> None:
        self.decode = decode
        self.prefill = prefill
        self.policy_name = policy
        self._decode_policy = make_policy(policy)
        self._prefill_policy = make_policy(policy)

    def route(self, input_ids: Sequence[int]) -> Route:
        """Pick (decode, prefill) for ``input_ids`` and count the request in flight on both.

        Raises:
            GatewayError: 503 when a configured role has no healthy worker.
        """
        decode = self._decode_policy.select(self.decode.available(), input_ids)
        prefill = None
        fallbacks: list[str] = []
        if self.prefill:
            available = self.prefill.available()
            prefill = self._prefill_policy.select(available, input_ids)
            prefill.in_flight += 1
            fallbacks = [w.address for w in available if w is not prefill]
        decode.in_flight += 1
        return Route(decode, prefill, fallbacks)

    def forget(self, role: str, worker: Worker) -> None:
        """Drop what the policy remembers about ``worker`` (it went unhealthy)."""
        policy = self._decode_policy if role == "decode" else self._prefill_policy
        policy.forget(worker)


def _rotate(workers: list[Worker], turn: int) -> list[Worker]:
    k = turn % len(workers)
    return workers[k:] + workers[:k]
