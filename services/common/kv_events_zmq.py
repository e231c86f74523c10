"""KV events in vLLM's KVEvents wire format over ZMQ (``--kv-events-endpoint``), for routers built
for vLLM's publisher (llm-d's precise prefix-cache scorer, Dynamo's KV router).

What vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``) sends, from the batches the
gRPC stream gets: ``KVEventPublisher.flush`` hands each batch to ``ZmqKVEventPublisher.publish`` on
the scheduler loop's thread, which only queues it; a thread of its own encodes it as vLLM's msgspec
``KVEventBatch`` (msgpack, array-like, events tagged by class name), sends
``[topic, seq as 8 bytes big-endian, payload]`` on a PUB socket, keeps the last ``buffer_steps``
payloads, and answers a replay request ``[identity, b"", start seq (8 bytes big-endian)]`` on the
ROUTER socket with ``[identity, b"", seq, payload]`` per held batch from ``start seq`` on, then
``[identity, b"", -1 (8 bytes, signed), b""]``. ``seq`` is the batch's own number (the gRPC
stream's). ``docs/kv-events.md`` has the schema and how the hashes map.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import msgspec
import zmq

from pdserve.mem_cache import kv_events
from pdserve.mem_cache.kv_tier import MEDIUM_TIER

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
MEDIUMS = {kv_events.MEDIUM_DEVICE: "GPU", MEDIUM_TIER: "CPU"}  # ours -> vLLM's


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM's ``KVCacheEvent``: encoded as ``[class name, *fields]``."""


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch``: ``[ts, events, data_parallel_rank]`` (the rank nil: a pdserve
    scheduler is not a data-parallel rank)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def to_vllm(batch: kv_events.KVEventBatch) -> KVEventBatch:
    """Our batch as vLLM's structs: the same hashes (uint64 ints), ``lora_id`` None (an adapter's
    blocks chain from its name's hash instead), medium ``"GPU"`` or ``"CPU"`` (the KV tier)."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for e in batch.events:
        if isinstance(e, kv_events.BlockStored):
            medium = MEDIUMS[e.medium]
            events.append(
                BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, None, medium)
            )
        elif isinstance(e, kv_events.BlockRemoved):
            events.append(BlockRemoved(e.block_hashes, MEDIUMS[e.medium]))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(batch.timestamp, events)


class ZmqKVEventPublisher:
    """vLLM's ZMQ KV event publisher, fed our batches.

    Args:
        endpoint: the PUB socket's endpoint (bound with a wildcard host or ipc/inproc, else connected).
        replay_endpoint: the ROUTER socket's endpoint (bound), or None: no replay.
        topic: the first frame of every message.
        buffer_steps: batches kept for replay.
        max_queue_size: batches queued for the thread; more are dropped (logged, and not held for
            replay either): the scheduler never waits; a consumer sees the gap in ``seq``.

    Raises:
        ValueError: an endpoint ZMQ refuses (malformed, address in use, ...).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        max_queue_size: int = 100_000,
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._queue: queue.Queue[kv_events.KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._topic = topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            self._pub.set_hwm(100_000)
            if "*" in endpoint or "::" in endpoint or not endpoint.startswith("tcp://"):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if self._replay is not None:
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-endpoint {endpoint} / replay {replay_endpoint}: {e}") from e
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    def publish(self, batch: kv_events.KVEventBatch) -> None:
        """Queue ``batch`` for the thread (a ``KVEventPublisher`` listener; never blocks)."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            logger.warning("KV events over ZMQ: queue full, batch %d dropped", batch.seq)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then stop the thread and the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV events over ZMQ: the publisher thread did not stop in %.1f s", timeout)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = self._encoder.encode(to_vllm(batch))
            self._pub.send_multipart((self._topic, batch.seq.to_bytes(8, "big"), payload))
            self._buffer.append((batch.seq, payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events over ZMQ: invalid replay request (%d frames)", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))
