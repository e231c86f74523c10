"""A consumer of KV events in vLLM's ZMQ wire format, written from vLLM's schema
(``vllm/distributed/kv_events.py``, as its ``examples/online_serving/kv_events_subscriber.py``
declares it), not from pdserve's code: the structs, a cache index, and the replay protocol."""

from __future__ import annotations

import msgspec
import zmq


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
TIMEOUT_MS = 5000


def apply(blocks: set[int], batch: KVEventBatch) -> None:
    for event in batch.events:
        if isinstance(event, BlockStored):
            assert event.parent_block_hash is None or event.parent_block_hash in blocks
            assert event.medium == "GPU" and event.lora_id is None
            blocks.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            blocks.difference_update(event.block_hashes)
        else:
            blocks.clear()


def replay(endpoint: str, start_seq: int) -> list[tuple[int, bytes]]:
    """vLLM's replay protocol over a DEALER socket: the held batches from ``start_seq`` on."""
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        got = []
        while True:
            assert sock.poll(TIMEOUT_MS), "the replay answers"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))
