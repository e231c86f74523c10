"""Router policies (``--router-policy``), applied separately to the decode pool and the prefill pool:

- ``round_robin``: the next healthy worker in turn.
- ``least_load``: the healthy worker with the fewest requests, by ``Worker.load``.
- ``cache_aware``: SGLang router's cache-aware policy: the worker whose approximate prefix tree
  (``ApproxPrefixTree``) holds the longest prefix of the prompt, unless that match covers less than
  ``cache_threshold`` of the prompt or the worker's load exceeds the least-loaded worker's by more
  than ``balance_threshold`` requests; then the least-loaded worker.
- ``kv_aware`` (the default): Dynamo KV router's cost shape over exact per-worker indexes built from
  the workers' KV events (``kv_index``, ``kv_subscriptions``). Each healthy worker scores
  ``overlap_weight * cached_prefix_blocks / prompt_blocks - load_weight * load / max_load`` (``load``
  as ``Worker.load``, ``max_load`` the largest among the candidates, at least 1); the best wins, ties
  go to the least loaded, then in turn. A worker whose index cannot be trusted (stream down or
  lagging) scores on load alone. A prompt's blocks routed to a worker count as cached there until
  its events name them, for ``kv_index.PENDING_S`` at most (``KVIndex.held_blocks``).

A request of a LoRA adapter (``lora_name``) reuses only its adapter's cached KV, which the workers'
radix caches keep under the adapter's own root: ``kv_aware`` hashes its blocks in a chain from
``namespace_hash(lora_name)`` (as the workers' KV events do) and ``cache_aware`` keys its tree on
the adapter. Every policy but ``round_robin`` then prefers, among equally good workers, one that
reported the adapter in its LoRA slots (``Worker.lora_resident``) over one that would load it
(evicting another); ``least_load`` and ``cache_aware`` only among the least loaded.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from pdserve.mem_cache.block_hash import block_hashes, namespace_hash
from pdserve.services.gateway.routing.kv_index import KVIndex
from pdserve.services.gateway.routing.kv_subscriptions import KVIndexes
from pdserve.services.gateway.routing.prefix_tree import ApproxPrefixTree
from pdserve.services.gateway.routing.workers import Worker, rotate

PolicyName = Literal["round_robin", "least_load", "cache_aware", "kv_aware"]
POLICIES: tuple[PolicyName, ...] = ("round_robin", "least_load", "cache_aware", "kv_aware")
DEFAULT_POLICY: PolicyName = "kv_aware"
PromptHashes = Callable[[int], list[int]]  # block size -> a prompt's block hashes


class Policy(Protocol):
    def select(self, workers: list[Worker], input_ids: Sequence[int], lora_name: str = "") -> Worker:
        """The worker for ``input_ids`` under LoRA adapter ``lora_name`` ("": the base model)."""

    def forget(self, worker: Worker) -> None: ...


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def select(self, workers: list[Worker], input_ids: Sequence[int], lora_name: str = "") -> Worker:
        return rotate(workers, next(self._turn))[0]

    def forget(self, worker: Worker) -> None:
        pass


class LeastLoadPolicy:
    """Fewest requests first; ties go to a worker holding the adapter, then round-robin so equal
    workers share the traffic."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def select(self, workers: list[Worker], input_ids: Sequence[int], lora_name: str = "") -> Worker:
        return min(rotate(workers, next(self._turn)), key=lambda w: (w.load, not w.holds(lora_name)))

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

    def select(self, workers: list[Worker], input_ids: Sequence[int], lora_name: str = "") -> Worker:
        least = self._least_load.select(workers, input_ids, lora_name)
        chosen = least
        # an adapter's prompts hang under its name (never equal to a token id): no match across
        key = [lora_name, *input_ids] if lora_name else input_ids
        skip = len(key) - len(input_ids)
        matches = {address: n - skip for address, n in self.tree.match(key).items()}
        candidates = [w for w in workers if matches.get(w.address, 0) > 0]
        if candidates:
            best = max(candidates, key=lambda w: (matches[w.address], -w.load))
            covered = matches[best.address] / max(len(input_ids), 1)
            if covered >= self.cache_threshold and best.load - least.load <= self.balance_threshold:
                chosen = best
        self.tree.insert(key, chosen.address)
        return chosen

    def forget(self, worker: Worker) -> None:
        self.tree.remove_tenant(worker.address)


@dataclass(frozen=True, slots=True)
class KVAwareWeights:
    """``kv_aware``'s knobs: ``overlap_weight`` (``--router-kv-overlap-weight``) and ``load_weight``
    (``--router-load-weight``), each in [0, 100]; ``lag_s`` (``--router-kv-event-lag``): seconds a
    worker may go without a KV event batch after a request was routed to it before its index is
    distrusted."""

    overlap_weight: float = 1.0
    load_weight: float = 0.5
    lag_s: float = 30.0


class KVAwarePolicy:
    """Cached prefix (from KV events) against load, as Dynamo's KV router scores (module docstring).

    Args:
        indexes: the pool's ``KVIndexes``.
        weights: the score's weights and the lag bound.
    """

    def __init__(self, indexes: KVIndexes, weights: KVAwareWeights) -> None:
        self.indexes = indexes
        self.weights = weights
        self._turn = itertools.count()

    def scores(
        self,
        workers: list[Worker],
        input_ids: Sequence[int],
        prompt_hashes: PromptHashes | None = None,
        lora_name: str = "",
    ) -> dict[str, float]:
        """address -> score of each of ``workers`` for the prompt ``input_ids`` under adapter
        ``lora_name``; ``prompt_hashes``: its block hashes by block size (``_prompt_hashes``),
        computed once per size."""
        hashes_of = prompt_hashes or _prompt_hashes(input_ids, lora_name)
        now = time.monotonic()
        max_load = max(1, *(w.load for w in workers))
        out = {}
        for w in workers:
            overlap = 0.0
            index = self.indexes.get(w.address)
            if index is not None and index.usable(now, self.weights.lag_s) and index.block_size:
                prompt = hashes_of(index.block_size)
                overlap = index.held_blocks(prompt, now) / len(prompt) if prompt else 0.0
            out[w.address] = (
                self.weights.overlap_weight * overlap - self.weights.load_weight * w.load / max_load
            )
        return out

    def select(self, workers: list[Worker], input_ids: Sequence[int], lora_name: str = "") -> Worker:
        hashes_of = _prompt_hashes(input_ids, lora_name)  # shared by the scores and the lag clock
        scores = self.scores(workers, input_ids, hashes_of)
        chosen = max(
            rotate(workers, next(self._turn)),
            key=lambda w: (scores[w.address], w.holds(lora_name), -w.load),
        )
        index = self.indexes.get(chosen.address)
        if index is not None:
            self._expect_batch(index, hashes_of)
        return chosen

    def _expect_batch(self, index: KVIndex, hashes_of: PromptHashes) -> None:
        """Start ``index``'s lag clock when the prompt has whole pages its worker does not hold (only
        those are sure to raise a ``BlockStored``); the block size is the pool's until it has its own."""
        block_size = index.block_size or self.indexes.block_size()
        if block_size:
            prompt = hashes_of(block_size)
            if index.cached_blocks(prompt) < len(prompt):
                index.routed(time.monotonic(), prompt)

    def forget(self, worker: Worker) -> None:
        index = self.indexes.get(worker.address)
        if index is not None:
            index.reset()


def _prompt_hashes(input_ids: Sequence[int], lora_name: str = "") -> PromptHashes:
    """A prompt's chained block hashes (``block_hashes``) for a block size, each size hashed once;
    an adapter's chain starts from ``namespace_hash(lora_name)``, as its worker's KV events do."""
    parent = namespace_hash(lora_name) if lora_name else None
    return functools.cache(lambda block_size: block_hashes(input_ids, block_size, parent))


def make_policy(
    name: PolicyName, indexes: KVIndexes | None = None, weights: KVAwareWeights | None = None
) -> Policy:
    """The policy ``name``; ``kv_aware`` needs the pool's ``indexes`` (ValueError otherwise)."""
    if name == "kv_aware":
        if indexes is None:
            raise ValueError("the kv_aware router policy needs the workers' KV indexes")
        return KVAwarePolicy(indexes, weights or KVAwareWeights())
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy()
    if name == "cache_aware":
        return CacheAwarePolicy()
    raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(POLICIES)}")
