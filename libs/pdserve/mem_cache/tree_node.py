"""A node of the radix cache's tree (``radix_cache.RadixCache``): one edge and where its KV lives."""

from __future__ import annotations


class TreeNode:
    """One edge of the tree and the node it ends in.

    ``key`` holds the edge's token ids (``len(key) == num_pages * page_size``, empty only for the
    root), ``value`` the KV page index of each of those pages, ``children`` maps the first page's
    token tuple of each child edge to the child, ``hashes`` the block hash of each page
    (``block_hash``; empty while the cache reports no events). ``host_value`` holds the node's KV
    tier pages instead while it lives in the tier (``value`` is empty then); a tier-resident node's
    descendants are tier-resident too, and it is never locked. ``lock_ref`` counts the locks held on
    this node or any descendant; ``last_access`` is the cache's logical clock at the last
    match/insert that passed through it.
    """

    __slots__ = (
        "children", "hashes", "host_value", "key", "last_access", "lock_ref", "node_id", "parent", "value",
    )  # fmt: skip

    def __init__(
        self,
        key: tuple[int, ...],
        value: list[int],
        parent: TreeNode | None,
        node_id: int,
        hashes: list[int] | None = None,
    ):
        self.key = key
        self.value = value
        self.host_value: list[int] | None = None
        self.hashes = hashes or []
        self.parent = parent
        self.node_id = node_id
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0

    @property
    def num_pages(self) -> int:
        return len(self.value) if self.host_value is None else len(self.host_value)

    @property
    def in_tier(self) -> bool:
        return self.host_value is not None
