"""Page-granular radix tree from token-id prefixes to KV page indices.

The prefix cache of SGLang's RadixAttention (Zheng et al., 2024, "SGLang: Efficient Execution of
Structured Language Model Programs"): finished (and partly prefilled) requests leave their KV pages
in a radix tree keyed by token ids, new requests reuse the longest cached prefix, reference counts
keep the pages of running requests in place, and least-recently-used leaves are evicted when the
KV pool runs short. Here the tree works in whole pages, as paged KV needs: every edge holds a
multiple of ``page_size`` tokens and one page index per ``page_size`` tokens.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol

from pdserve.mem_cache.block_hash import block_hashes, namespace_hash
from pdserve.mem_cache.kv_events import MEDIUM_DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdserve.mem_cache.kv_tier import MEDIUM_TIER, KVTier
from pdserve.mem_cache.radix_tier import RadixTier
from pdserve.mem_cache.tree_node import TreeNode


class PageFreer(Protocol):
    """The one allocator call the cache makes: hand evicted KV pages back to the pool."""

    def free(self, pages: Iterable[int]) -> None: ...


class MatchResult(NamedTuple):
    """Longest cached prefix of a query.

    ``page_indices``: the KV pages of the matched prefix, in token order; ``last_node``: the node the
    match ends in (the root on a miss), which the caller locks to keep those pages; ``num_tokens``:
    ``len(page_indices) * page_size``; ``tier_nodes``: the tier-resident nodes the match goes on
    through after ``last_node``, in path order (``RadixCache.load_back`` brings them into the pool).
    """

    page_indices: list[int]
    last_node: TreeNode
    num_tokens: int
    tier_nodes: tuple[TreeNode, ...] = ()


class RadixCache(RadixTier):
    """Prefix cache of KV pages, shared by every request of one scheduler.

    Invariants:

    - Every page index in the tree appears once and is owned by the tree: it goes back to the
      allocator only through :meth:`evict` or :meth:`reset`.
    - While a node is locked (:meth:`inc_lock_ref` more often than :meth:`dec_lock_ref`), it and
      all its ancestors stay in the tree, and the pages on the path from the root to it stay valid
      and are neither freed nor reused. A later match or insert may split an edge on that path, but
      the path still carries the same pages in the same order, and the caller's node object stays
      the one that ends it.
    - ``evictable_size() + protected_size() == total_size()``: pages on unlocked nodes versus pages
      on locked paths.
    - A :class:`MatchResult`'s pages are safe to use only while its ``last_node`` is locked (or
      until the next :meth:`evict` / :meth:`reset`).

    Namespaces: requests of a LoRA adapter (``pdserve.lora``) compute different KV for the same
    tokens, so each adapter's prefixes hang under a root of their own (``namespace``: the adapter's
    name; ``""``, the base model's, is ``root``) and a match never crosses adapters; in KV events an
    adapter's first blocks chain from ``namespace_hash(name)`` (the base model's from no parent). Eviction and
    locks treat every root alike (no parent); a namespace's root stays once made (one per adapter).

    With ``disable=True`` (``--disable-radix-cache``) nothing is cached: matches are empty misses,
    and insert hands every page back to the caller to free.

    With an event sink (:meth:`set_event_sink`), every page gets its chained block hash when it is
    inserted, and the cache reports KV events (``kv_events``): ``BlockStored`` for each new leaf,
    ``BlockRemoved`` for each evicted node, ``AllBlocksCleared`` on :meth:`reset`. Splitting an edge
    changes no block, so it reports nothing.

    With a KV tier (``kv_tier.KVTier``, ``--kv-tier-memory``), eviction writes back: an evicted
    node's KV is copied into tier pages and the node stays in the tree, tier-resident (HiCache's
    ``host_value``), reported as ``BlockRemoved`` on the device and ``BlockStored`` in the tier
    medium. A match runs on through tier-resident nodes (``MatchResult.tier_nodes``) and
    :meth:`load_back` copies them into pool pages the caller allocated (removed from the tier,
    stored on the device). A full tier drops its least-recently-used tier-resident leaves
    (``BlockRemoved`` in the tier). ``evictable_size`` and ``total_size`` count pool pages only.

    Eviction gathers the unlocked leaves (O(nodes)) into a heap and pops them oldest first
    (O(k log nodes) for k evicted nodes). Not thread-safe: one scheduler thread owns it.
    """

    def __init__(
        self, allocator: PageFreer, page_size: int, disable: bool = False, tier: KVTier | None = None
    ):
        """Raises ValueError when ``page_size < 1``."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.tier = tier
        self._node_ids = itertools.count()
        self._clock = itertools.count(1)
        self.root = TreeNode((), [], None, next(self._node_ids))
        self._roots: dict[str, TreeNode] = {"": self.root}  # namespace -> its root
        self._evictable = 0
        self._protected = 0
        self._events: Callable[[KVEvent], None] | None = None

    def set_event_sink(self, sink: Callable[[KVEvent], None]) -> None:
        """Report KV events to ``sink`` from now on (instead of an earlier sink); pages cached already
        get their block hashes now, so :meth:`snapshot_events` names them."""
        self._events = sink
        for node in self._parents_first():
            node.hashes = block_hashes(node.key, self.page_size, self._parent_hash(node))

    def match_prefix(self, token_ids: Sequence[int], namespace: str = "") -> MatchResult:
        """Longest cached prefix of ``token_ids`` in whole pages, in ``namespace`` (a LoRA adapter's
        name; ``""``: the base model); a trailing partial page never matches. The part in the pool
        ends at ``last_node``; the tier-resident part after it is ``tier_nodes``.

        Splits an edge at the page boundary where the match ends inside it, so the match ends
        exactly at a node, and marks the matched path as just used (LRU).
        """
        node = last = self._root(namespace)
        if self.disable:
            return MatchResult([], node, 0)
        key = self._page_aligned(token_ids)
        tick = next(self._clock)
        pages: list[int] = []
        tier_nodes: list[TreeNode] = []
        pos = 0
        while pos < len(key) and (child := node.children.get(key[pos : pos + self.page_size])):
            num_matched = self._matched_pages(child.key, key, pos)
            if num_matched < child.num_pages:
                child = self._split(child, num_matched)
            child.last_access = tick
            if child.in_tier:
                tier_nodes.append(child)
            else:
                pages.extend(child.value)
                last = child
            pos += len(child.key)
            node = child
        return MatchResult(pages, last, len(pages) * self.page_size, tuple(tier_nodes))

    def insert(self, token_ids: Sequence[int], page_indices: Sequence[int], namespace: str = "") -> list[int]:
        """Cache the KV pages of ``token_ids``'s whole pages in ``namespace`` (as ``match_prefix``);
        returns the caller's pages to free.

        ``page_indices`` must hold exactly ``len(token_ids) // page_size`` pages, the one for tokens
        ``[i * page_size, (i + 1) * page_size)`` at position i; tokens of a trailing partial page are
        ignored (the caller keeps that page). Where the tree already caches a page of this prefix
        under another index, the caller's page is a duplicate: it is returned, in token order, and
        the caller must free it. Every other page passes to the tree, which frees it on eviction.
        Pages equal to the tree's own (they came from a match) are neither returned nor taken again.
        A caller that keeps running (chunked prefill) then matches again, locks the new
        ``last_node``, unlocks its old one, and uses the matched pages in place of its duplicates.
        Raises ValueError on a page count that does not fit.
        """
        num_pages = len(token_ids) // self.page_size
        if len(page_indices) != num_pages:
            raise ValueError(
                f"{len(token_ids)} tokens with page_size {self.page_size} need {num_pages} pages, "
                f"got {len(page_indices)}"
            )
        if self.disable:
            return list(page_indices)
        key = self._page_aligned(token_ids)
        tick = next(self._clock)
        node = self._root(namespace)
        duplicates: list[int] = []
        pos = 0
        while pos < len(key):
            first_page = key[pos : pos + self.page_size]
            page = pos // self.page_size
            child = node.children.get(first_page)
            if child is None:
                leaf = TreeNode(key[pos:], list(page_indices[page:]), node, next(self._node_ids))
                leaf.last_access = tick
                node.children[first_page] = leaf
                self._evictable += leaf.num_pages
                self._report_stored(leaf)
                break
            num_matched = self._matched_pages(child.key, key, pos)
            if num_matched < child.num_pages:
                child = self._split(child, num_matched)
            child.last_access = tick
            ours = page_indices[page : page + num_matched]
            if child.in_tier:  # the caller computed the KV of a tier-resident prefix again
                self._to_device(child, ours)
            duplicates.extend(mine for mine, cached in zip(ours, child.value, strict=True) if mine != cached)
            pos += len(child.key)
            node = child
        return duplicates

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node`` and its ancestors against eviction (the root is never evicted anyway)."""
        while node.parent is not None:  # a root is never evicted
            if node.lock_ref == 0:
                self._evictable -= node.num_pages
                self._protected += node.num_pages
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock_ref` on ``node``; raises ValueError if ``node`` is not locked."""
        if node.key and node.lock_ref == 0:  # a root's key is empty (and it is never locked)
            raise ValueError("dec_lock_ref on a node that is not locked")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= node.num_pages
                self._evictable += node.num_pages
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free least-recently-used unlocked leaves until ``num_pages`` pages are freed.

        Whole nodes go, so more than ``num_pages`` may be freed; a parent becomes a candidate once
        its last child is gone. Stops early when nothing evictable remains. Returns pages freed.
        With a tier, the evicted nodes' KV is written back to it (see the class docstring).
        """
        return self._evict(num_pages, report=True, to_tier=self.tier is not None)

    def drop_namespace(self, namespace: str) -> int:
        """Free every unlocked page cached in ``namespace`` (an unloaded LoRA adapter's: an adapter
        loaded later under its name must not read that KV), and its tier pages, reporting the
        removals; pool pages freed."""
        root = self._roots.get(namespace)
        if root is None:
            return 0
        freed = self._evict(self._evictable, report=True, roots=[root])
        self._drop_tier(self._tier_size(), report=True, roots=[root])
        return freed

    def _evict(
        self, num_pages: int, report: bool, roots: Iterable[TreeNode] | None = None, to_tier: bool = False
    ) -> int:
        heap = [(leaf.last_access, leaf.node_id, leaf) for leaf in self._evictable_leaves(roots)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent, pages = node.parent, node.value
            self._evictable -= node.num_pages
            if not (to_tier and self._write_back(node)):
                self._remove(node, report)
            self.allocator.free(pages)
            freed += len(pages)
            if parent.parent is not None and parent.lock_ref == 0 and not self._device_children(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def _remove(self, node: TreeNode, report: bool) -> None:
        """Take ``node`` and its descendants (all tier-resident) out of the tree, children first,
        freeing their tier pages; the caller frees a device node's pool pages."""
        order, stack = [], [node]
        while stack:
            stack.extend((gone := stack.pop()).children.values())
            order.append(gone)
        for gone in reversed(order):
            if gone.in_tier:
                self.tier.allocator.free(gone.host_value)
            if report and self._events is not None:
                self._events(BlockRemoved(gone.hashes, MEDIUM_TIER if gone.in_tier else MEDIUM_DEVICE))
            del gone.parent.children[gone.key[: self.page_size]]
            gone.parent = None

    def reset(self) -> None:
        """Free every cached page and empty the tree; raises RuntimeError while any node is locked."""
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} pages still locked")
        self._evict(self._evictable, report=False)
        self._drop_tier(self._tier_size(), report=False)
        if self._events is not None:
            self._events(AllBlocksCleared())

    def snapshot_events(self) -> list[BlockStored]:
        """What the cache holds, as one ``BlockStored`` per node, parents before children (empty
        without an event sink)."""
        if self._events is None:
            return []
        return [self._stored(node) for node in self._parents_first()]

    def evictable_size(self) -> int:
        """Pages on unlocked nodes (what :meth:`evict` could free now)."""
        return self._evictable

    def protected_size(self) -> int:
        """Pages on locked paths."""
        return self._protected

    def total_size(self) -> int:
        """All pool pages the tree holds."""
        return self._evictable + self._protected

    def _parents_first(self) -> Iterator[TreeNode]:
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @staticmethod
    def _parent_hash(node: TreeNode) -> int | None:
        """The hash of the page before ``node``'s first (None under the root)."""
        return node.parent.hashes[-1] if node.parent.hashes else None

    def _stored(self, node: TreeNode) -> BlockStored:
        medium = MEDIUM_TIER if node.in_tier else MEDIUM_DEVICE
        return BlockStored(list(node.hashes), self._parent_hash(node), list(node.key), self.page_size, medium)

    def _report_stored(self, leaf: TreeNode) -> None:
        """Hash a new leaf's pages (chained from its parent's last page) and report them."""
        if self._events is None:
            return
        leaf.hashes = block_hashes(leaf.key, self.page_size, self._parent_hash(leaf))
        self._events(self._stored(leaf))

    def _root(self, namespace: str) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            # the adapter's hash is its first blocks' parent: no block hash is shared across adapters
            hashes = [namespace_hash(namespace)]
            root = self._roots[namespace] = TreeNode((), [], None, next(self._node_ids), hashes)
        return root

    def _page_aligned(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        return tuple(token_ids[: len(token_ids) // self.page_size * self.page_size])

    def _matched_pages(self, edge: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
        """Leading whole pages of ``edge`` equal to ``key[start:]``; the first is known to match."""
        size = self.page_size
        limit = min(len(edge), len(key) - start)
        end = size
        while end < limit and edge[end : end + size] == key[start + end : start + end + size]:
            end += size
        return end // size

    def _split(self, child: TreeNode, num_pages: int) -> TreeNode:
        """Cut ``child``'s edge after ``num_pages`` pages; returns the new upper node."""
        cut = num_pages * self.page_size
        upper = TreeNode(
            child.key[:cut],
            child.value[:num_pages],
            child.parent,
            next(self._node_ids),
            child.hashes[:num_pages],
        )
        upper.lock_ref = child.lock_ref
        if child.in_tier:
            upper.host_value, child.host_value = child.host_value[:num_pages], child.host_value[num_pages:]
        upper.children[child.key[cut : cut + self.page_size]] = child
        child.parent.children[child.key[: self.page_size]] = upper
        child.key = child.key[cut:]
        child.value = child.value[num_pages:]
        child.hashes = child.hashes[num_pages:]
        child.parent = upper
        return upper

    def _evictable_leaves(self, roots: Iterable[TreeNode] | None = None) -> Iterator[TreeNode]:
        roots = self._roots.values() if roots is None else roots
        stack = [child for root in roots for child in root.children.values() if not child.in_tier]
        while stack:
            node = stack.pop()
            if on_device := self._device_children(node):
                stack.extend(on_device)
            elif node.lock_ref == 0:
                yield node

    @staticmethod
    def _device_children(node: TreeNode) -> list[TreeNode]:
        return [child for child in node.children.values() if not child.in_tier]
