"""The gateway's per-worker KV index and the kv_aware policy, fed with the events of a real radix cache.

Each batch goes the way it goes in a deployment: a real ``RadixCache`` raises the events, a real
``KVEventPublisher`` numbers them and serves snapshots and replays, the scheduler's converter makes
the protobuf message and the gateway's converter reads it back. The expected cached prefix of a
prompt is the radix cache's own ``match_prefix``.
"""

from __future__ import annotations

import logging
import random
import time

import pytest

from pdserve.mem_cache.block_hash import block_hashes
from pdserve.mem_cache.kv_events import BlockStored, KVEventBatch, KVEventPublisher, KVEventSubscription
from pdserve.mem_cache.memory_pool import PagedTokenToKVPoolAllocator
from pdserve.mem_cache.radix_cache import RadixCache
from pdserve.services.common import convert as scheduler_convert
from pdserve.services.gateway.routing import kv_index
from pdserve.services.gateway.routing.kv_index import KVIndex, KVIndexGap
from pdserve.services.gateway.routing.kv_subscriptions import KVIndexes
from pdserve.services.gateway.routing.policies import KVAwarePolicy, KVAwareWeights
from pdserve.services.gateway.routing.workers import WorkerPool
from pdserve.services.gateway.transport import convert
from pdserve.services.gateway.transport.backend_clients import BackendClients

PAGE = 4


class Worker:
    """One scheduler's radix cache and event publisher."""

    def __init__(self, pages: int = 64) -> None:
        self.cache = RadixCache(PagedTokenToKVPoolAllocator(pages, PAGE), PAGE)
        self.publisher = KVEventPublisher(self.cache.snapshot_events)
        self.cache.set_event_sink(self.publisher.record)

    def cache_prompt(self, tokens: list[int], namespace: str = "") -> None:
        """A finished request's pages (of LoRA adapter ``namespace``) enter the cache; the step's
        batch is closed."""
        pages = self.cache.allocator.alloc(len(tokens) // PAGE)
        self.cache.allocator.free(self.cache.insert(tokens, pages, namespace))
        self.publisher.flush()

    def cached_blocks(self, tokens: list[int]) -> int:
        return self.cache.match_prefix(tokens).num_tokens // PAGE


def wire(batch: KVEventBatch) -> tuple[str, KVEventBatch]:
    """Through protobuf, scheduler side to gateway side: (incarnation, batch)."""
    return convert.kv_event_batch_from_pb(scheduler_convert.kv_event_batch_to_pb(batch))


async def catch_up(index: KVIndex, worker: Worker, sub: KVEventSubscription, now: float = 0.0) -> None:
    """Apply ``sub``'s batches until the index is as of the worker's last batch."""
    index.apply(*wire(await anext(sub)), now)
    while index.seq != worker.publisher.seq:
        index.apply(*wire(await anext(sub)), now)


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts that share prefixes of one another (whole pages and partial ones)."""
    out: list[list[int]] = [[rng.randrange(1000) for _ in range(24)]]
    for _ in range(n - 1):
        base = rng.choice(out)
        out.append(
            base[: rng.randrange(len(base))] + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
        )
    return out


def assert_index_is_the_cache(index: KVIndex, worker: Worker, tokens: list[list[int]]) -> None:
    expected = {e.block_hashes[i] for e in worker.cache.snapshot_events() for i in range(len(e.block_hashes))}
    assert set(index.blocks) == expected
    for t in tokens:
        assert index.cached_blocks(block_hashes(t, PAGE)) == worker.cached_blocks(t)


async def test_live_batches_snapshot_eviction_and_clear() -> None:
    rng, worker, index = random.Random(0), Worker(), KVIndex("decode", "w:1")
    sub = worker.publisher.subscribe()  # a snapshot of the empty cache first
    tokens = prompts(rng, 12)
    for t in tokens:
        worker.cache_prompt(t)
    await catch_up(index, worker, sub)
    assert index.block_size == PAGE and index.seq == worker.publisher.seq
    assert_index_is_the_cache(index, worker, tokens)
    worker.cache.evict(5)
    worker.publisher.flush()
    await catch_up(index, worker, sub)
    assert_index_is_the_cache(index, worker, tokens)
    worker.cache.reset()
    worker.publisher.flush()
    await catch_up(index, worker, sub)
    assert index.blocks == {} and all(index.cached_blocks(block_hashes(t, PAGE)) == 0 for t in tokens)
    sub.close()


async def test_snapshot_replaces_and_replay_resumes_after_a_reconnect() -> None:
    rng, worker = random.Random(1), Worker()
    tokens = prompts(rng, 16)
    for t in tokens[:8]:
        worker.cache_prompt(t)
    index = KVIndex("decode", "w:1")
    index.blocks = {123: None}  # stale content a snapshot must replace
    sub = worker.publisher.subscribe()
    await catch_up(index, worker, sub)
    assert_index_is_the_cache(index, worker, tokens[:8])
    sub.close()  # the stream breaks; the worker goes on caching
    for t in tokens[8:]:
        worker.cache_prompt(t)
    worker.cache.evict(3)
    worker.publisher.flush()
    replay = worker.publisher.subscribe(index.seq + 1)
    await catch_up(index, worker, replay)
    assert_index_is_the_cache(index, worker, tokens)
    replay.close()


async def test_a_gap_or_another_incarnation_is_refused_until_a_snapshot() -> None:
    worker, index = Worker(), KVIndex("decode", "w:1")
    sub = worker.publisher.subscribe()
    await catch_up(index, worker, sub)
    tokens = [[k] * 8 for k in range(1, 4)]  # a batch each
    for t in tokens:
        worker.cache_prompt(t)
    await anext(sub)  # batch 1 never reaches the index
    incarnation, batch = wire(await anext(sub))
    with pytest.raises(KVIndexGap, match="batch 2"):
        index.apply(incarnation, batch, 0.0)
    with pytest.raises(KVIndexGap, match="restarted"):
        index.apply("restarted", KVEventBatch(1, 0.0, batch.events), 0.0)
    index.reset()
    snapshot = worker.publisher.subscribe()
    await catch_up(index, worker, snapshot)
    assert_index_is_the_cache(index, worker, tokens)
    sub.close()
    snapshot.close()


async def test_usable_only_while_connected_in_step_and_of_one_block_size(caplog) -> None:
    worker, index = Worker(), KVIndex("decode", "w:1")
    sub = worker.publisher.subscribe()
    caplog.set_level(logging.INFO, logger="pdserve.services.gateway.routing.kv_index")
    assert not index.usable(0.0, 30.0)  # never subscribed
    assert not index.usable(0.5, 30.0)  # (logged once)
    index.connected = True
    await catch_up(index, worker, sub, now=0.0)
    assert index.usable(1.0, 30.0)
    index.routed(2.0)
    index.routed(20.0)  # the bound runs from the first request without a batch since
    assert index.usable(32.0, 30.0)
    assert [index.usable(t, 30.0) for t in (32.5, 33.0, 40.0)] == [False] * 3
    worker.cache_prompt(list(range(8)))
    await catch_up(index, worker, sub, now=41.0)
    assert index.usable(41.0, 30.0)
    lines = [r.getMessage() for r in caplog.records if r.name.endswith(".kv_index")]
    assert lines[0] == "decode worker w:1: its KV event stream is down; routing it by load alone"
    assert len(lines) == 4 and "KV index in step" in lines[1] and "KV index in step" in lines[3]
    lag = "its KV events lag: none for 30.5 s since a request went there"
    assert lines[2] == f"decode worker w:1: {lag}; routing it by load alone"
    tokens = list(range(2 * PAGE))  # a batch that names blocks of another size
    stored = BlockStored(block_hashes(tokens, 2 * PAGE), None, tokens, 2 * PAGE)
    index.apply(*wire(KVEventBatch(index.seq + 1, 0.0, [stored])), 42.0)
    assert not index.usable(42.0, 30.0)
    assert caplog.records[-1].getMessage().startswith("decode worker w:1: it sent blocks of 8 and 4 tokens")
    sub.close()


async def followed(workers: dict[str, Worker]) -> dict[str, KVIndex]:
    """A connected index of each worker (by address), caught up with its events."""
    indexes = {address: KVIndex("decode", address) for address in workers}
    for address, worker in workers.items():
        indexes[address].connected = True
        await catch_up(indexes[address], worker, worker.publisher.subscribe())
    return indexes


def policy(indexes: dict[str, KVIndex], weights: KVAwareWeights = KVAwareWeights()) -> KVAwarePolicy:
    kv = KVIndexes(BackendClients(), WorkerPool("decode", list(indexes)))
    kv.indexes.update(indexes)
    return KVAwarePolicy(kv, weights)


async def test_kv_aware_scores_cached_prefix_against_load() -> None:
    a, b = Worker(), Worker()
    system = list(range(100, 164))  # 16 pages
    a.cache_prompt(system)
    b.cache_prompt(system[:16])
    indexes = await followed({"a:1": a, "b:1": b})
    p = policy(indexes)
    pool = WorkerPool("decode", list(indexes))
    wa, wb = pool.workers
    prompt = system + [7, 7, 7]  # 16 whole pages
    assert p.scores(pool.workers, prompt) == {"a:1": 1.0, "b:1": 0.25}
    assert {p.select(pool.workers, prompt).address for _ in range(4)} == {"a:1"}
    later = time.monotonic() + 100
    assert indexes["a:1"].usable(later, 30.0)  # a held every page of those prompts: no batch is due
    wa.in_flight = 4  # a's score: 1.0 - 0.5 * 4/4; b's 0.25
    assert p.scores(pool.workers, prompt) == {"a:1": 0.5, "b:1": 0.25}
    assert p.select(pool.workers, prompt) is wa
    heavy = policy(indexes, KVAwareWeights(overlap_weight=1.0, load_weight=2.0))
    assert heavy.select(pool.workers, prompt) is wb
    # no prefix anywhere: the least loaded, then in turn among equals
    assert {p.select(pool.workers, [1, 2, 3, 4, 5]).address for _ in range(4)} == {"b:1"}
    assert not indexes["b:1"].usable(later, 30.0)  # b lacked that page: a batch was due
    wa.in_flight = 0  # a prompt without a whole page: nothing cached or pending anywhere
    assert {p.select(pool.workers, [1, 2, 3]).address for _ in range(4)} == {"a:1", "b:1"}
    # a's stream is down: its index is unknown and it is scored on load alone
    indexes["a:1"].connected = False
    # (the prompt heavy routed to b is pending there: its blocks count until b's events name them)
    assert p.scores(pool.workers, prompt) == {"a:1": 0.0, "b:1": 1.0}
    p.forget(wb)  # b went unhealthy: its index waits for a snapshot
    assert indexes["b:1"].seq is None and p.scores(pool.workers, prompt) == {"a:1": 0.0, "b:1": 0.0}


async def test_kv_aware_finds_an_adapters_prefix_under_its_namespace() -> None:
    """A LoRA adapter's cached pages chain from its name's hash in the events: the router hashes an
    adapter prompt the same way, so it finds them, and never under the base model or another adapter."""
    a, b = Worker(), Worker()
    system = list(range(100, 164))  # 16 pages
    a.cache_prompt(system, "pirate")
    b.cache_prompt(system)
    indexes = await followed({"a:1": a, "b:1": b})
    p = policy(indexes)
    pool = WorkerPool("decode", list(indexes))
    prompt = system + [7]
    assert p.scores(pool.workers, prompt, lora_name="pirate") == {"a:1": 1.0, "b:1": 0.0}
    assert p.scores(pool.workers, prompt) == {"a:1": 0.0, "b:1": 1.0}
    assert p.scores(pool.workers, prompt, lora_name="poet") == {"a:1": 0.0, "b:1": 0.0}
    assert {p.select(pool.workers, prompt, "pirate").address for _ in range(4)} == {"a:1"}
    assert {p.select(pool.workers, prompt).address for _ in range(4)} == {"b:1"}


async def test_kv_aware_keeps_a_new_prefix_together_until_its_events_arrive() -> None:
    """A prefix no worker holds goes to the least loaded; the requests that share it and arrive before
    that worker's events name its blocks follow it there (pending blocks), though it is now busier.
    Once stored, the blocks are the index's; pending ones expire after PENDING_S, and a clear (or a
    forgotten worker) drops them."""
    a, b = Worker(), Worker()
    a.cache_prompt(list(range(900, 908)))  # something else each: their indexes know the page size
    b.cache_prompt(list(range(800, 808)))
    subs = {"a:1": a.publisher.subscribe(), "b:1": b.publisher.subscribe()}
    indexes = {address: KVIndex("decode", address) for address in subs}
    for address, worker in (("a:1", a), ("b:1", b)):
        indexes[address].connected = True
        await catch_up(indexes[address], worker, subs[address])
    p = policy(indexes)
    pool = WorkerPool("decode", list(indexes))
    wa, wb = pool.workers
    system = list(range(100, 132))  # 8 pages
    wb.in_flight = 1
    assert p.select(pool.workers, system + [1]) is wa
    wa.in_flight = 2  # a is busier now, its prefill still running
    assert p.scores(pool.workers, system + [2]) == {"a:1": 1.0 - 0.5, "b:1": -0.5 * 1 / 2}
    assert {p.select(pool.workers, system + [i]).address for i in range(3, 7)} == {"a:1"}
    assert p.select(pool.workers, list(range(200, 232))) is wb  # another prefix: by load
    hashes = block_hashes(system, PAGE)
    assert len(indexes["a:1"].pending) == 8
    later = time.monotonic() + kv_index.PENDING_S + 1
    assert indexes["a:1"].held_blocks(hashes, later) == 0  # expired, with still no event
    p.select(pool.workers, system + [1])  # pending again; then the worker's events name the blocks
    a.cache_prompt(system + [1])
    await catch_up(indexes["a:1"], a, subs["a:1"])
    assert not indexes["a:1"].pending and indexes["a:1"].held_blocks(hashes, later) == 8
    p.select(pool.workers, list(range(300, 332)))
    assert indexes["a:1"].pending or indexes["b:1"].pending
    p.forget(wa)
    p.forget(wb)
    assert not indexes["a:1"].pending and not indexes["b:1"].pending
    for sub in subs.values():
        sub.close()
