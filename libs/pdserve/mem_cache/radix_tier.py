"""The radix cache's KV tier operations: write-back on evict, load back, LRU drop of the tier.

A mixin of ``RadixCache`` (``radix_cache.py``: its class docstring has the semantics), kept apart so
that each file has one job: the tree there, where a node's KV lives here.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from pdserve.mem_cache.kv_events import MEDIUM_DEVICE, BlockRemoved, KVEvent
from pdserve.mem_cache.kv_tier import MEDIUM_TIER, KVTier
from pdserve.mem_cache.tree_node import TreeNode

if TYPE_CHECKING:
    from collections.abc import Callable


class RadixTier:
    """Tier-residency of ``RadixCache`` nodes; uses the cache's ``tier`` (None: no tier, and none
    of this runs), ``_events``, ``_evictable``, ``_roots``, ``_remove`` and ``_stored``."""

    tier: KVTier | None
    _events: Callable[[KVEvent], None] | None

    def load_back(self, nodes: Sequence[TreeNode], pages: Sequence[int]) -> int:
        """Copy the KV of a match's ``tier_nodes`` into pool ``pages`` (in path order, one per page)
        and make them device nodes over those pages; stops at a node the tier dropped since the
        match (making room for ``pages`` may have). Returns how many of ``pages`` it used; the
        caller frees the rest, and must hold a lock on the match's ``last_node`` throughout."""
        used = 0
        for node in nodes:
            if node.parent is None or not node.in_tier:
                break
            mine = pages[used : used + node.num_pages]
            self.tier.load(node.host_value, mine)
            self._to_device(node, mine)
            used += len(mine)
        return used

    def _write_back(self, node: TreeNode) -> bool:
        """Copy device ``node``'s KV into tier pages and make it tier-resident (the caller frees its
        pool pages); False when the tier cannot hold it even after dropping its LRU leaves."""
        if node.num_pages > self.tier.num_pages:
            return False
        short = node.num_pages - self.tier.allocator.available_size()
        if short > 0:
            self._drop_tier(short, report=True)
        tier_pages = self.tier.allocator.alloc(node.num_pages)
        if tier_pages is None:
            return False
        self.tier.save(node.value, tier_pages)
        node.value, node.host_value = [], tier_pages
        self._report_moved(node, MEDIUM_DEVICE)
        return True

    def _to_device(self, node: TreeNode, pages: Sequence[int]) -> None:
        """Tier-resident ``node``'s KV is in pool ``pages`` now: free its tier pages."""
        self.tier.allocator.free(node.host_value)
        node.host_value, node.value = None, list(pages)
        self._evictable += node.num_pages
        self._report_moved(node, MEDIUM_TIER)

    def _drop_tier(self, num_pages: int, report: bool, roots: Iterable[TreeNode] | None = None) -> int:
        """Drop least-recently-used tier-resident leaves until ``num_pages`` tier pages are free again
        (or none is left); returns the tier pages freed."""
        if num_pages <= 0 or self.tier is None:
            return 0
        heap = [(node.last_access, node.node_id, node) for node in self._tier_leaves(roots)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += node.num_pages
            self._remove(node, report)
            if parent.in_tier and not parent.children:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def _tier_size(self) -> int:
        return 0 if self.tier is None else self.tier.used_pages()

    def _report_moved(self, node: TreeNode, source: str) -> None:
        """Report ``node``'s blocks gone from ``source`` and stored where the node lives now."""
        if self._events is not None:
            self._events(BlockRemoved(list(node.hashes), source))
            self._events(self._stored(node))

    def _tier_leaves(self, roots: Iterable[TreeNode] | None = None) -> Iterator[TreeNode]:
        roots = self._roots.values() if roots is None else roots
        stack = [child for root in roots for child in root.children.values()]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.in_tier:
                yield node
