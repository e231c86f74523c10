"""Unit tests of the KV tier under the radix cache: write-back on evict, match over tier-resident
nodes, load back (the KV bytes round-trip), LRU drop of a full tier, KV events, reset, and the
tier's pages conserved."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.mem_cache.block_hash import block_hashes
from pdserve.mem_cache.kv_events import MEDIUM_DEVICE, BlockRemoved, BlockStored
from pdserve.mem_cache.kv_tier import MEDIUM_TIER, KVTier
from pdserve.mem_cache.memory_pool import KVPool, PagedTokenToKVPoolAllocator
from pdserve.mem_cache.radix_cache import RadixCache

PAGE = 2


def make(pool_pages: int = 8, tier_pages: int = 4) -> tuple[RadixCache, KVPool, list]:
    pool = KVPool(pool_pages, PAGE, num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.bfloat16)
    cache = RadixCache(PagedTokenToKVPoolAllocator(pool_pages, PAGE), PAGE, tier=KVTier(pool, tier_pages))
    events: list = []
    cache.set_event_sink(events.append)
    return cache, pool, events


def put(cache: RadixCache, pool: KVPool, tokens: list[int]) -> tuple[list[int], torch.Tensor]:
    """Insert ``tokens`` over newly allocated pages holding random KV (freeing those the cache holds
    already, as a request does); returns the pages and their KV."""
    pages = cache.allocator.alloc(len(tokens) // PAGE)
    kv = torch.randn(pool.kv_data[pages].shape).to(pool.dtype)
    pool.kv_data[pages] = kv
    cache.allocator.free(cache.insert(tokens, pages))
    return pages, kv


def tier_pages_held(cache: RadixCache) -> int:
    return sum(len(node.host_value) for node in cache._parents_first() if node.in_tier)


def test_evicted_pages_go_to_the_tier_and_come_back_bit_exact():
    cache, pool, events = make()
    pages, kv = put(cache, pool, [1, 2, 3, 4, 5, 6])
    assert cache.evict(3) == 3
    assert cache.total_size() == 0 and cache.allocator.available_size() == 8
    assert cache.tier.used_pages() == tier_pages_held(cache) == 3
    pool.kv_data.zero_()  # the pool pages are reused; only the tier has the KV now

    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert (match.page_indices, match.num_tokens, match.last_node) == ([], 0, cache.root)
    assert [node.key for node in match.tier_nodes] == [(1, 2, 3, 4, 5, 6)]
    new = cache.allocator.alloc(3)
    assert cache.load_back(match.tier_nodes, new) == 3
    assert torch.equal(pool.kv_data[new], kv)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).page_indices == new
    assert cache.tier.used_pages() == tier_pages_held(cache) == 0
    assert cache.evictable_size() == 3

    a, b, c = block_hashes([1, 2, 3, 4, 5, 6], PAGE)
    assert events[1:] == [
        BlockRemoved([a, b, c]),
        BlockStored([a, b, c], None, [1, 2, 3, 4, 5, 6], PAGE, MEDIUM_TIER),
        BlockRemoved([a, b, c], MEDIUM_TIER),
        BlockStored([a, b, c], None, [1, 2, 3, 4, 5, 6], PAGE),
    ]


def test_match_runs_from_device_pages_into_the_tier_and_splits_there():
    cache, pool, _ = make()
    put(cache, pool, [1, 2, 3, 4])
    put(cache, pool, [1, 2, 3, 4, 5, 6, 7, 8])  # a child edge (5 6 7 8) under (1 2 3 4)
    cache.evict(2)  # the leaf goes to the tier, its parent stays on the device
    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 9, 9])
    assert match.num_tokens == 4 and match.last_node.key == (1, 2, 3, 4)
    (tier_node,) = match.tier_nodes
    assert tier_node.key == (5, 6) and tier_node.in_tier and len(tier_node.host_value) == 1
    (rest,) = tier_node.children.values()
    assert rest.key == (7, 8) and rest.in_tier
    assert cache.tier.used_pages() == tier_pages_held(cache) == 2
    # the parent is evictable again once its only child lives in the tier
    assert cache.evictable_size() == 2 and cache.evict(2) == 2
    assert cache.tier.used_pages() == 4 and cache.total_size() == 0


def test_a_full_tier_drops_its_least_recently_used_leaves():
    cache, pool, events = make(tier_pages=3)
    put(cache, pool, [1, 1, 1, 1])  # 2 pages
    put(cache, pool, [2, 2, 2, 2])  # 2 pages
    cache.evict(2)  # (1 1 1 1): the older one
    cache.evict(2)  # (2 2 2 2) needs room: (1 1 1 1) is dropped
    assert cache.match_prefix([1, 1, 1, 1, 0]).tier_nodes == ()
    assert len(cache.match_prefix([2, 2, 2, 2, 0]).tier_nodes) == 1
    assert BlockRemoved(block_hashes([1, 1, 1, 1], PAGE), MEDIUM_TIER) in events
    assert cache.tier.used_pages() == tier_pages_held(cache) == 2
    # a node larger than the whole tier is simply freed
    put(cache, pool, [3] * 8)
    cache.evict(cache.evictable_size())
    assert cache.match_prefix([3] * 8).tier_nodes == ()
    assert cache.tier.used_pages() == tier_pages_held(cache) == 2


def test_insert_over_a_tier_resident_prefix_takes_the_callers_pages():
    cache, pool, events = make()
    put(cache, pool, [1, 2, 3, 4])
    cache.evict(2)
    pages, _ = put(cache, pool, [1, 2, 3, 4, 5, 6])  # recomputed: the caller's pages win
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).page_indices == pages
    assert cache.tier.used_pages() == 0 and cache.total_size() == 3
    assert events[-2:][0] == BlockStored(block_hashes([1, 2, 3, 4], PAGE), None, [1, 2, 3, 4], PAGE)


def test_load_back_stops_at_a_node_dropped_meanwhile_and_reset_clears_the_tier():
    cache, pool, events = make(tier_pages=2)
    put(cache, pool, [1, 2, 3, 4])
    cache.evict(2)
    match = cache.match_prefix([1, 2, 3, 4])
    cache._drop_tier(2, report=True)  # (what making room for the load-back may do)
    assert cache.load_back(match.tier_nodes, [0, 1]) == 0
    put(cache, pool, [5, 6])
    cache.evict(1)
    assert cache.tier.used_pages() == 1
    snapshot = cache.snapshot_events()
    assert [event.medium for event in snapshot] == [MEDIUM_TIER]
    cache.reset()
    assert cache.tier.used_pages() == 0 and not cache.root.children
    assert cache.allocator.available_size() == 8


def test_a_tier_refuses_a_pool_it_cannot_hold():
    pool = KVPool(4, PAGE, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="at least one page"):
        KVTier(pool, 0)


def test_random_churn_keeps_kv_pages_events_and_both_ledgers_exact():
    """Seeded random inserts, matches with load-back, evictions and resets over a small pool and
    tier: every page (in the pool or the tier) holds its own prefix's KV, both pools are conserved,
    and an index built from the events alone names each cached block in the medium it is in."""
    pool = KVPool(10, PAGE, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    cache = RadixCache(PagedTokenToKVPoolAllocator(10, PAGE), PAGE, tier=KVTier(pool, 12))
    index: dict[int, str] = {}

    def apply(event) -> None:
        if isinstance(event, BlockStored):
            index.update(dict.fromkeys(event.block_hashes, event.medium))
        elif isinstance(event, BlockRemoved):
            assert all(index.pop(block) == event.medium for block in event.block_hashes)
        else:
            index.clear()

    cache.set_event_sink(apply)
    kv_of = lambda prefix: float(hash(prefix) % 100_003)  # a page's KV: a function of its prefix
    rng = random.Random(0)
    loaded_back = 0
    for step in range(400):
        tokens = [rng.randrange(2) for _ in range(rng.randrange(2, 13))]
        match = cache.match_prefix(tokens)
        cache.inc_lock_ref(match.last_node)
        loaded = sum(node.num_pages for node in match.tier_nodes)
        if loaded and cache.allocator.available_size() + cache.evictable_size() >= loaded:
            if cache.allocator.available_size() < loaded:
                cache.evict(loaded - cache.allocator.available_size())
            pages = cache.allocator.alloc(loaded)
            used = cache.load_back(match.tier_nodes, pages)
            loaded_back += used
            cache.allocator.free(pages[used:])
            cache.dec_lock_ref(match.last_node)
            match = cache.match_prefix(tokens)
            cache.inc_lock_ref(match.last_node)
        need = len(tokens) // PAGE - len(match.page_indices)
        if cache.allocator.available_size() < need:
            cache.evict(need - cache.allocator.available_size())
        own = cache.allocator.alloc(need) or []
        if len(own) == need:
            pages = match.page_indices + own
            for i, page in enumerate(pages):
                pool.kv_data[page] = kv_of(tuple(tokens[: (i + 1) * PAGE]))
            cache.allocator.free(cache.insert(tokens, pages))
        cache.dec_lock_ref(match.last_node)
        if step % 97 == 96:
            cache.reset()
        held = {}
        for node, prefix in walk(cache):
            for i in range(node.num_pages):
                key = prefix[: len(prefix) - len(node.key) + (i + 1) * PAGE]
                data = cache.tier.kv_data[node.host_value[i]] if node.in_tier else pool.kv_data[node.value[i]]
                assert torch.all(data == kv_of(key)), f"step {step}: wrong KV for {key}"
            held.update(dict.fromkeys(node.hashes, MEDIUM_TIER if node.in_tier else MEDIUM_DEVICE))
        assert index == held
        assert cache.tier.used_pages() == tier_pages_held(cache)
        assert cache.allocator.available_size() + cache.total_size() == 10
    assert loaded_back > 50  # the churn did go through the tier


def walk(cache: RadixCache):
    """Every node with the tokens from the root to its end."""
    stack = [(child, tuple(child.key)) for child in cache.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        yield node, prefix
        stack.extend((child, prefix + tuple(child.key)) for child in node.children.values())
