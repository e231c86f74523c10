"""Unit tests of RadixCache: edge splits, duplicate pages on insert, locks, LRU eviction order."""

import pytest

from pdserve.mem_cache.block_hash import namespace_hash
from pdserve.mem_cache.radix_cache import RadixCache


class FreedLog:
    """Allocator side of the cache that records which pages come back, in order (LRU tests read it)."""

    def __init__(self) -> None:
        self.pages: list[int] = []

    def free(self, pages) -> None:
        self.pages.extend(pages)


def make_cache(page_size: int = 2, disable: bool = False) -> tuple[RadixCache, FreedLog]:
    log = FreedLog()
    return RadixCache(log, page_size, disable=disable), log


def test_match_splits_edge_at_page_boundary():
    cache, _ = make_cache(page_size=2)
    assert cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == []
    (edge,) = cache.root.children.values()
    assert edge.key == (1, 2, 3, 4, 5, 6)

    pages, node, num_tokens, _ = cache.match_prefix([1, 2, 3, 4, 9, 9, 7])
    assert (pages, num_tokens) == ([10, 11], 4)
    assert node.key == (1, 2, 3, 4) and node.value == [10, 11] and node.parent is cache.root
    (rest,) = node.children.values()
    assert rest.key == (5, 6) and rest.value == [12] and rest.parent is node
    assert list(node.children) == [(5, 6)]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).page_indices == [10, 11, 12]
    assert cache.total_size() == cache.evictable_size() == 3


def test_match_counts_whole_pages_only():
    cache, _ = make_cache(page_size=4)
    cache.insert(list(range(8)), [3, 4])
    # Mismatch inside the second page: only the first page matches.
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 9, 7]).page_indices == [3]
    # A trailing partial page never matches, even when its tokens agree.
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 6]).page_indices == [3]
    assert cache.match_prefix([0, 1, 2]) == ([], cache.root, 0, ())
    assert cache.match_prefix([]) == ([], cache.root, 0, ())


def test_insert_returns_only_differing_duplicates():
    cache, _ = make_cache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    prefix = cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).page_indices
    # The matched pages are the tree's own; only the new page joins; the partial page is ignored.
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], [*prefix, 12]) == []
    assert cache.total_size() == 3
    # Same prefix computed again on other pages: those are duplicates for the caller to free.
    assert cache.insert([1, 2, 3, 4, 5, 6, 8, 8], [20, 21, 22, 23]) == [20, 21, 22]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 8, 8]).page_indices == [10, 11, 12, 23]
    assert cache.total_size() == 4


def test_insert_rejects_page_count_that_does_not_fit():
    cache, _ = make_cache(page_size=2)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], [10, 11])
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [10])
    with pytest.raises(ValueError):
        RadixCache(FreedLog(), page_size=0)


def test_evict_takes_least_recently_used_leaf_first():
    cache, log = make_cache(page_size=1)
    cache.insert([1, 1], [10, 11])
    cache.insert([2, 2], [20, 21])
    cache.insert([3], [30])
    cache.match_prefix([2, 2])
    cache.match_prefix([1])  # splits [1, 1]: only the upper page is touched
    cache.match_prefix([3])
    assert cache.evict(1) == 1 and log.pages == [11]
    assert cache.evict(1) == 2 and log.pages == [11, 20, 21]
    assert cache.evict(5) == 2 and log.pages == [11, 20, 21, 10, 30]
    assert cache.total_size() == 0 and cache.root.children == {}


def test_parent_becomes_candidate_after_its_children():
    cache, log = make_cache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    cache.insert([1, 2, 5, 6], [10, 12])
    cache.insert([7, 8], [13])
    cache.match_prefix([7, 8])  # now the newest; the [1, 2] branch is older
    assert cache.evict(3) == 3
    assert log.pages == [11, 12, 10]
    assert cache.match_prefix([7, 8]).page_indices == [13]


def test_locked_path_survives_eviction_and_splits():
    cache, log = make_cache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    cache.insert([9, 9], [13])
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    cache.inc_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (3, 1)
    # A match ending inside the locked edge splits it; the lock covers both halves.
    upper = cache.match_prefix([1, 2, 0, 0]).last_node
    assert upper.lock_ref == node.lock_ref == 1 and node.parent is upper
    assert cache.evict(10) == 1 and log.pages == [13]
    assert cache.protected_size() == 3
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).page_indices == [10, 11, 12]
    cache.dec_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 3)
    assert cache.evict(1) == 2 and log.pages == [13, 11, 12]
    with pytest.raises(ValueError):
        cache.dec_lock_ref(node)


def test_reset_frees_every_page_and_refuses_while_locked():
    cache, log = make_cache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    cache.insert([1, 2, 5, 6], [10, 12])
    node = cache.match_prefix([1, 2, 5, 6]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert sorted(log.pages) == [10, 11, 12]
    assert cache.total_size() == 0 and cache.match_prefix([1, 2]).page_indices == []


def test_disabled_cache_keeps_nothing():
    cache, log = make_cache(page_size=2, disable=True)
    assert cache.insert([1, 2, 3, 4, 5], [10, 11]) == [10, 11]
    result = cache.match_prefix([1, 2, 3, 4])
    assert result == ([], cache.root, 0, ())
    cache.inc_lock_ref(result.last_node)
    cache.dec_lock_ref(result.last_node)
    assert cache.evict(4) == 0 and log.pages == []
    assert cache.total_size() == 0


def test_lora_namespaces_never_share_pages():
    """Each LoRA adapter's prefixes live under a root of their own: the same tokens match only in
    the namespace that cached them; locks, eviction and KV events treat every namespace alike, and
    an adapter's first blocks chain from its name's hash, so no block hash is shared either."""
    cache, log = make_cache(page_size=2)
    events = []
    cache.set_event_sink(events.append)
    assert cache.insert([1, 2, 3, 4], [10, 11]) == []
    assert cache.match_prefix([1, 2, 3, 4, 5], "pirate").num_tokens == 0
    assert cache.insert([1, 2, 3, 4], [20, 21], "pirate") == []  # not duplicates: other KV
    assert cache.match_prefix([1, 2, 3, 4, 5], "pirate").page_indices == [20, 21]
    assert cache.match_prefix([1, 2, 3, 4, 5]).page_indices == [10, 11]
    base, pirate = events[0], events[1]
    assert base.parent_block_hash is None and pirate.parent_block_hash == namespace_hash("pirate")
    assert not set(base.block_hashes) & set(pirate.block_hashes)
    node = cache.match_prefix([1, 2, 3, 4], "pirate").last_node
    cache.inc_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (2, 2)
    assert cache.evict(4) == 2 and log.pages == [10, 11]  # the locked namespace's pages stay
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0 and log.pages == [10, 11, 20, 21]


def test_drop_namespace_frees_only_that_adapters_pages():
    """An unloaded adapter's namespace is emptied (its pages freed, removals reported); the base
    model's and other adapters' cached pages stay, and the same tokens under the name miss after."""
    cache, log = make_cache(page_size=2)
    events = []
    cache.set_event_sink(events.append)
    cache.insert([1, 2, 3, 4], [10, 11])
    cache.insert([1, 2, 3, 4], [20, 21], "pirate")
    cache.insert([1, 2, 5, 6], [20, 22], "pirate")  # a split: two nodes under "pirate"
    cache.insert([1, 2], [30], "poet")
    assert cache.drop_namespace("pirate") == 3 and sorted(log.pages) == [20, 21, 22]
    assert sorted(h for e in events[4:] for h in e.block_hashes) == sorted(
        h for e in events[1:3] for h in e.block_hashes
    )  # every stored pirate block is reported removed
    assert cache.match_prefix([1, 2, 3, 4], "pirate").num_tokens == 0
    assert cache.match_prefix([1, 2, 3, 4]).page_indices == [10, 11]
    assert cache.match_prefix([1, 2], "poet").page_indices == [30]
    assert cache.total_size() == 3 and cache.drop_namespace("nobody") == 0
