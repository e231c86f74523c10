"""Unit tests of the KV block hash, the radix cache's KV events and the publisher's ring, replay,
snapshot and overflow (the stateful radix-cache test checks an event-built index against the tree)."""

from __future__ import annotations

import asyncio
import hashlib
import struct

import pytest

from pdserve.mem_cache.block_hash import block_hash, block_hashes
from pdserve.mem_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    KVEventsOverflow,
)
from pdserve.mem_cache.memory_pool import PagedTokenToKVPoolAllocator
from pdserve.mem_cache.radix_cache import RadixCache


def blake(data: bytes) -> int:
    """The documented definition (docs/kv-events.md), written out from hashlib."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"pdserve-kv-v1").digest(), "little")


def test_block_hash_is_the_documented_blake2b_chain():
    first = blake(struct.pack("<3I", 1, 2, 70000))
    second = blake(struct.pack("<Q", first) + struct.pack("<3I", 5, 6, 7))
    assert block_hash(None, [1, 2, 70000]) == first
    assert block_hashes([1, 2, 70000, 5, 6, 7, 8], 3) == [first, second]  # the partial page has none
    assert block_hashes([5, 6, 7], 3, parent=first) == [second]
    assert block_hash(None, [5, 6, 7]) != second  # a hash names the whole prefix
    with pytest.raises(ValueError, match="token ids"):
        block_hash(None, [-1])
    with pytest.raises(ValueError, match="at least one"):
        block_hash(None, [])
    with pytest.raises(ValueError, match="page_size"):
        block_hashes([1], 0)


def cache_with_events(page_size: int = 2, pages: int = 16) -> tuple[RadixCache, list]:
    cache = RadixCache(PagedTokenToKVPoolAllocator(pages, page_size), page_size)
    events: list = []
    cache.set_event_sink(events.append)
    return cache, events


def test_radix_cache_reports_new_leaves_evictions_and_reset():
    cache, events = cache_with_events()
    pages = cache.allocator.alloc(3)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], pages) == []
    a, b, c = block_hashes([1, 2, 3, 4, 5, 6], 2)
    assert events == [BlockStored([a, b, c], None, [1, 2, 3, 4, 5, 6], 2)]
    # a branch after the first page splits the edge (no event) and stores only its own block
    assert cache.insert([1, 2, 9, 9], [pages[0], *cache.allocator.alloc(1)]) == []
    (d,) = block_hashes([9, 9], 2, parent=a)
    assert events[1:] == [BlockStored([d], a, [9, 9], 2)]
    assert cache.evict(1) == 2  # the least recently used leaf: [3..6]
    assert events[2:] == [BlockRemoved([b, c])]
    cache.reset()
    assert events[3:] == [AllBlocksCleared()]  # a reset reports no removals of its own
    assert cache.allocator.available_size() == 16


def test_a_sink_set_on_a_filled_cache_gets_its_blocks_in_snapshots():
    cache = RadixCache(PagedTokenToKVPoolAllocator(4, 1), 1)
    cache.insert([1, 2], cache.allocator.alloc(2))
    cache.insert([1, 3], [cache.match_prefix([1]).page_indices[0], *cache.allocator.alloc(1)])
    events: list = []
    cache.set_event_sink(events.append)  # (a second scheduler loop over the same scheduler)
    a, b = block_hashes([1, 2], 1)
    (c,) = block_hashes([3], 1, parent=a)
    assert events == []
    assert sorted(cache.snapshot_events(), key=lambda e: e.block_hashes) == sorted(
        [BlockStored([a], None, [1], 1), BlockStored([b], a, [2], 1), BlockStored([c], a, [3], 1)],
        key=lambda e: e.block_hashes,
    )


async def read(sub, n: int) -> list:
    return [await anext(sub) for _ in range(n)]


def test_publisher_numbers_batches_replays_and_snapshots():
    async def run() -> None:
        cache, _ = cache_with_events()
        publisher = KVEventPublisher(cache.snapshot_events, ring_size=2, queue_size=8)
        cache.set_event_sink(publisher.record)
        live = publisher.subscribe()  # from a snapshot of the empty cache, as of batch 0
        for step in range(3):
            cache.insert([step, step], cache.allocator.alloc(1))
            publisher.flush()
        publisher.flush()  # a step without events sends nothing
        snapshot, *batches = await read(live, 4)
        assert (snapshot.seq, snapshot.snapshot, snapshot.events) == (0, True, [AllBlocksCleared()])
        assert [b.seq for b in batches] == [1, 2, 3] and not any(b.snapshot for b in batches)
        assert [b.events[0].token_ids for b in batches] == [[0, 0], [1, 1], [2, 2]]

        replay = publisher.subscribe(from_seq=2)  # the ring (2 batches) still holds 2 and 3
        assert [b.seq for b in await read(replay, 2)] == [2, 3]
        caught_up = publisher.subscribe(from_seq=4)  # nothing missed: live batches only
        cache.evict(1)
        publisher.flush()
        assert [b.seq for b in await read(caught_up, 1)] == [4]
        assert (await anext(replay)).events == [BlockRemoved(block_hashes([0, 0], 2))]

        for from_seq in (1, 9, None):  # gone from the ring, from the future, unset: a snapshot
            (batch,) = await read(publisher.subscribe(from_seq), 1)
            assert batch.snapshot and batch.seq == 4
            assert batch.events == [AllBlocksCleared(), *cache.snapshot_events()]
            assert {e.token_ids[0] for e in batch.events[1:]} == {1, 2}

        publisher.close()  # streams end after what they have not read
        with pytest.raises(StopAsyncIteration):
            await anext(caught_up)

    asyncio.run(run())


def test_slow_subscriber_is_cut_off_without_blocking():
    async def run() -> None:
        cache, _ = cache_with_events(pages=8)
        publisher = KVEventPublisher(cache.snapshot_events, queue_size=2)
        cache.set_event_sink(publisher.record)
        slow, fast = publisher.subscribe(), publisher.subscribe()
        await read(fast, 1)
        for step in range(3):  # the slow one holds 2 unread batches when the third comes
            cache.insert([step, step], cache.allocator.alloc(1))
            publisher.flush()
            if step < 2:
                await read(fast, 1)
        await anext(slow)  # its snapshot (read from its own list, before the queue)
        with pytest.raises(KVEventsOverflow, match="fell 2 batches behind"):
            await anext(slow)
        assert [b.seq for b in await read(fast, 1)] == [3]  # the others go on
        again = publisher.subscribe(from_seq=None)
        assert (await anext(again)).snapshot

    asyncio.run(run())
