"""KV events: what a scheduler's radix cache stores, removes and clears, in numbered batches.

The events are vLLM's KVEvents (``vllm/distributed/kv_events.py``: ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), with a block being one KV page and its hash ``block_hash.block_hash``.
``KVEventPublisher`` gathers the events of one scheduler step into a ``KVEventBatch`` with the next
sequence number, keeps the most recent batches in a ring for replay, and hands each batch to every
subscriber's bounded queue; a subscriber that falls ``queue_size`` batches behind is cut off
(``KVEventsOverflow``) instead of slowing the scheduler. A subscription starts with a replay from
the ring, or with a snapshot of the whole cache (``docs/kv-events.md`` has the semantics).

Not thread-safe: the publisher, its subscribers and the radix cache live on the scheduler's loop thread.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

MEDIUM_DEVICE = "device"  # the scheduler's KV pool (GPU or CPU memory, wherever the model runs)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks ``block_hashes`` (one per page, chained) now cached, after block ``parent_block_hash``
    (None: they start a prefix of the base model; a LoRA adapter's prefixes start after
    ``block_hash.namespace_hash(adapter name)``); ``token_ids`` holds their
    ``len(block_hashes) * block_size`` ids."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks ``block_hashes`` evicted (each block's descendants were removed before it)."""

    block_hashes: list[int]
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of the cache is gone (a reset; also the first event of a snapshot)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The events of one scheduler step, numbered ``seq`` (1, 2, ... per publisher), at
    ``timestamp`` (Unix seconds). A ``snapshot`` batch (``AllBlocksCleared`` then a ``BlockStored``
    per cached edge, parents first) is the whole cache as of batch ``seq``; its ``seq`` is not new."""

    seq: int
    timestamp: float
    events: list[KVEvent] = field(default_factory=list)
    snapshot: bool = False


class KVEventsOverflow(Exception):
    """A subscriber fell too far behind and was cut off; it must subscribe again (and gets a snapshot)."""


class KVEventSubscription:
    """One consumer's stream: ``async for batch in subscription``; ends when the publisher closes,
    raises ``KVEventsOverflow`` once cut off. ``close`` it when done."""

    def __init__(self, publisher: KVEventPublisher, first: list[KVEventBatch], queue_size: int) -> None:
        self._publisher = publisher
        self._first = deque(first)
        self._queue: asyncio.Queue[KVEventBatch | None] = asyncio.Queue()
        self.queue_size = queue_size
        self.overflowed = False
        self._ended = False

    def put(self, batch: KVEventBatch) -> bool:
        """Queue ``batch``; False (and cut off) when ``queue_size`` batches are unread already."""
        if self._queue.qsize() >= self.queue_size:
            self.overflowed = True
            self.end()
            return False
        self._queue.put_nowait(batch)
        return True

    def end(self) -> None:
        """Wake the consumer to end its stream (after what it has not read, unless cut off)."""
        if self._ended:
            return
        self._ended = True
        if self.overflowed:
            while not self._queue.empty():
                self._queue.get_nowait()
        self._queue.put_nowait(None)

    def close(self) -> None:
        self._publisher.unsubscribe(self)

    def __aiter__(self) -> AsyncIterator[KVEventBatch]:
        return self

    async def __anext__(self) -> KVEventBatch:
        if self._first:
            return self._first.popleft()
        batch = await self._queue.get()
        if batch is not None:
            return batch
        if self.overflowed:
            raise KVEventsOverflow(
                f"KV event subscriber fell {self.queue_size} batches behind and was cut off:"
                " subscribe again (from a snapshot)"
            )
        raise StopAsyncIteration


class KVEventPublisher:
    """The KV event stream of one scheduler.

    Args:
        snapshot: the cache's current content as ``BlockStored`` events, parents first
            (``RadixCache.snapshot_events``); called on the loop thread when a subscriber needs it.
        ring_size: how many recent batches are kept for replay.
        queue_size: how many batches a subscriber may fall behind before it is cut off.

    Raises:
        ValueError: a size below 1.
    """

    def __init__(
        self, snapshot: Callable[[], list[BlockStored]], ring_size: int = 1024, queue_size: int = 256
    ) -> None:
        if ring_size < 1 or queue_size < 1:
            raise ValueError(f"ring_size and queue_size must be >= 1, got {ring_size}, {queue_size}")
        self._snapshot = snapshot
        self._ring: deque[KVEventBatch] = deque(maxlen=ring_size)
        self._pending: list[KVEvent] = []
        self._subscribers: list[KVEventSubscription] = []
        self.queue_size = queue_size
        self.seq = 0  # the last batch's number
        self.listeners: list[Callable[[KVEventBatch], None]] = []  # also given every batch (must not block)

    def record(self, event: KVEvent) -> None:
        """Add ``event`` to the current step's batch (the radix cache's event sink)."""
        self._pending.append(event)

    def flush(self) -> None:
        """Close the current step's batch (nothing when it is empty): number it, keep it, send it."""
        if not self._pending:
            return
        self.seq += 1
        batch = KVEventBatch(self.seq, time.time(), self._pending)
        self._pending = []
        self._ring.append(batch)
        self._subscribers = [sub for sub in self._subscribers if sub.put(batch)]
        for listener in self.listeners:
            listener(batch)

    def subscribe(self, from_seq: int | None = None) -> KVEventSubscription:
        """A new subscriber's stream: the batches from ``from_seq`` on when the ring still holds them
        all (``from_seq == seq + 1``: only the batches to come), else (or with None) a snapshot
        batch first; then every later batch. Call it on the loop thread."""
        self.flush()
        oldest = self._ring[0].seq if self._ring else self.seq + 1
        if from_seq is not None and oldest <= from_seq <= self.seq + 1:
            first = [batch for batch in self._ring if batch.seq >= from_seq]
        else:
            events: list[KVEvent] = [AllBlocksCleared(), *self._snapshot()]
            first = [KVEventBatch(self.seq, time.time(), events, snapshot=True)]
        sub = KVEventSubscription(self, first, self.queue_size)
        self._subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: KVEventSubscription) -> None:
        if sub in self._subscribers:
            self._subscribers.remove(sub)

    def close(self) -> None:
        """Flush, then end every subscriber's stream (after the batches it has not read)."""
        self.flush()
        for sub in self._subscribers:
            sub.end()
        self._subscribers = []
