"""Router policies (``--router-policy``), applied separately to the decode pool and the prefill pool:

- ``round_robin``: the next healthy worker in turn.
- ``least_load``: the healthy worker with the fewest requests, by ``Worker.load``.
- ``cache_aware``: SGLang router's cache-aware policy: the worker whose approximate prefix tree
  (``ApproxPrefixTree``) holds the longest prefix of the prompt, unless that match covers less than
  ``cache_threshold`` of the prompt or the worker's load exceeds the least-loaded worker's by more
  than ``balance_threshold`` requests; then the least-loaded worker.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal, Protocol

from pdserve.services.gateway.routing.prefix_tree import ApproxPrefixTree
from pdserve.services.gateway.routing.workers import Worker, rotate

PolicyName = Literal["round_robin", "least_load", "cache_aware"]
POLICIES: tuple[PolicyName, ...] = ("round_robin", "least_load", "cache_aware")


class Policy(Protocol):
    def select(self, workers: list[Worker], input_ids: Sequence[int]) -> Worker: ...

    def forget(self, worker: Worker) -> None: ...


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def select(self, workers: list[Worker], input_ids: Sequence[int]) -> Worker:
        return rotate(workers, next(self._turn))[0]

    def forget(self, worker: Worker) -> None:
        pass


class LeastLoadPolicy:
    """Fewest requests first; ties go round-robin so equal workers share the traffic."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def select(self, workers: list[Worker], input_ids: Sequence[int]) -> Worker:
        return min(rotate(workers, next(self._turn)), key=lambda w: w.load)

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
