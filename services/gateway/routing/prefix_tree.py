"""An approximate prefix tree of recent prompts per worker, for cache-aware routing.

After SGLang's router (sgl-router, "cache-aware load balancing"): the gateway cannot see the
workers' radix caches, so it keeps its own radix tree over the token ids it routed, each node
tagged with the workers ("tenants") it was sent to and when. A new prompt's longest match in the
tree estimates which worker holds most of its KV in cache. Every tenant's share of the tree is
bounded: past ``max_tokens_per_tenant`` tokens, its least recently used leaves are evicted, as the
worker's own cache would do.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "key", "parent", "tenants")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, tenants: dict[str, int]) -> None:
        self.key = key  # token ids on the edge from the parent
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.tenants = tenants  # tenant -> last access tick

    def is_tenant_leaf(self, tenant: str) -> bool:
        return tenant in self.tenants and not any(tenant in c.tenants for c in self.children.values())


class ApproxPrefixTree:
    """Radix tree over token ids with per-tenant LRU bounds.

    Invariant: a node's tenants are a subset of its parent's (an insert tags the whole path), so
    the tenants at the deepest node a prompt reaches are exactly those with the longest match.

    Args:
        max_tokens_per_tenant: tokens a tenant may hold before its LRU leaves are evicted (to 90%).
    """

    def __init__(self, max_tokens_per_tenant: int = 1 << 18) -> None:
        self.max_tokens_per_tenant = max_tokens_per_tenant
        self.root = _Node((), None, {})
        self.tenant_tokens: dict[str, int] = {}
        self._tick = 0

    def match(self, ids: Sequence[int]) -> dict[str, int]:
        """Matched prefix length (tokens) of ``ids`` for every tenant that shares at least one token."""
        matched: dict[str, int] = {}
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_prefix(child.key, ids, pos)
            pos += n
            for tenant in child.tenants:
                matched[tenant] = pos
            if n < len(child.key):
                break
            node = child
        return matched

    def insert(self, ids: Sequence[int], tenant: str) -> None:
        """Record that ``ids`` was sent to ``tenant``; evict the tenant's LRU leaves if over its bound."""
        self._tick += 1
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                leaf = _Node(tuple(ids[pos:]), node, {})
                node.children[ids[pos]] = leaf
                self._tag(leaf, tenant)
                break
            n = _common_prefix(child.key, ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            self._tag(child, tenant)
            pos += n
            node = child
        if self.tenant_tokens.get(tenant, 0) > self.max_tokens_per_tenant:
            self._evict(tenant, int(self.max_tokens_per_tenant * 0.9))

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything routed to ``tenant`` (its worker went away and lost its cache)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and tenant in node.tenants:
                self._untag(node, tenant)
        self.tenant_tokens.pop(tenant, None)

    def _tag(self, node: _Node, tenant: str) -> None:
        if tenant not in node.tenants:
            self.tenant_tokens[tenant] = self.tenant_tokens.get(tenant, 0) + len(node.key)
        node.tenants[tenant] = self._tick

    def _untag(self, node: _Node, tenant: str) -> None:
        del node.tenants[tenant]
        self.tenant_tokens[tenant] -= len(node.key)
        if not node.tenants:
            del node.parent.children[node.key[0]]

    def _split(self, child: _Node, n: int) -> _Node:
        """Split ``child``'s edge after ``n`` tokens; returns the new upper node."""
        parent = child.parent
        mid = _Node(child.key[:n], parent, dict(child.tenants))
        parent.children[mid.key[0]] = mid
        child.key = child.key[n:]
        child.parent = mid
        mid.children[child.key[0]] = child
        return mid

    def _evict(self, tenant: str, target: int) -> None:
        heap: list[tuple[int, int, _Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and node.is_tenant_leaf(tenant):
                heap.append((node.tenants[tenant], id(node), node))
        heapq.heapify(heap)
        while heap and self.tenant_tokens[tenant] > target:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._untag(node, tenant)
            if parent is not self.root and parent.is_tenant_leaf(tenant):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))


def _common_prefix(key: tuple[int, ...], ids: Sequence[int], start: int) -> int:
    n = min(len(key), len(ids) - start)
    i = 0
    while i < n and key[i] == ids[start + i]:
        i += 1
    return i
