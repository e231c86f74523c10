"""Issue 40 (KV events) on the real colocated stack: a subscriber over real gRPC sees the blocks of two
prompts sharing a prefix stored under the hashes a router computes from the token ids, sees a flush
clear them, and a reconnect from a sequence number replays what it missed; the same batches reach a
consumer of vLLM's ZMQ wire format (``--kv-events-endpoint``), live and by replay."""

from __future__ import annotations

import grpc
import httpx
import pytest
import zmq

from pdserve.mem_cache.block_hash import block_hashes
from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.kv_event_index import Index
from tests.kv_events_vllm import DECODER, TIMEOUT_MS, AllBlocksCleared, BlockRemoved, BlockStored, replay
from tests.reference import hf_tokenizer

DECODE_OFFSET = 20  # the colocated decode scheduler's internal port, above the stack's base
PAGE = 16  # the stack's --page-size (the default)


def generate(stack, input_ids: list[int]) -> None:
    params = {"temperature": 0, "max_new_tokens": 4}
    r = httpx.post(
        f"{stack.base_url}/generate", json={"input_ids": input_ids, "sampling_params": params}, timeout=300
    )
    assert r.status_code == 200, r.text


def assert_zmq_events_equal(sub: zmq.Socket, replay_port: int, batches: list) -> None:
    """The ZMQ consumer (its PUB joined) gets ``batches`` (gRPC ``KVEventBatch``es) under the same
    seqs, live and by replay, equal event for event."""
    replayed = replay(f"tcp://127.0.0.1:{replay_port}", batches[0].seq)
    assert [seq for seq, _ in replayed] == [b.seq for b in batches]
    live: dict[int, bytes] = {}
    while batches[-1].seq not in live:
        assert sub.poll(TIMEOUT_MS), f"live ZMQ batches (got {sorted(live)})"
        _, seq, payload = sub.recv_multipart()
        live[int.from_bytes(seq, "big")] = payload
    sub.close(linger=0)
    assert all(live.get(seq) == payload for seq, payload in replayed), "each batch also came live"
    for (_, payload), batch in zip(replayed, batches, strict=True):
        vllm = DECODER.decode(payload)
        assert abs(vllm.ts - batch.timestamp_unix_s) < 1e-6
        assert len(vllm.events) == len(batch.events)
        for ours, event in zip(vllm.events, batch.events, strict=True):
            kind = event.WhichOneof("event")
            if kind == "block_stored":
                e = event.block_stored
                parent = e.parent_block_hash if e.HasField("parent_block_hash") else None
                hashes, tokens = list(e.block_hashes), list(e.token_ids)
                expected = BlockStored(hashes, parent, tokens, e.block_size, None, "GPU")
            elif kind == "block_removed":
                expected = BlockRemoved(list(event.block_removed.block_hashes), "GPU")
            else:
                expected = AllBlocksCleared()
            assert ours == expected


def test_kv_events_name_the_prompt_blocks_and_replay_after_a_reconnect(colocated):
    channel = grpc.insecure_channel(f"127.0.0.1:{colocated.internal_port_base + DECODE_OFFSET}")
    stub = scheduler_pb2_grpc.DecodeSchedulerStub(channel)
    zmq_sub = zmq.Context.instance().socket(zmq.SUB)  # the scheduler's PUB connects to it
    zmq_sub.bind(f"tcp://127.0.0.1:{colocated.extra['kv_events_zmq']}")
    zmq_sub.setsockopt(zmq.SUBSCRIBE, b"")
    for _ in range(100):  # flush (the stack is idle) until the PUB has joined (ZMQ's slow joiner)
        assert stub.FlushCache(scheduler_pb2.FlushCacheRequest(), timeout=30).flushed
        if zmq_sub.poll(100):
            break
    else:
        pytest.fail("the scheduler's ZMQ PUB never connected")
    index = Index(stub.SubscribeKVEvents(scheduler_pb2.KVEventsRequest(), timeout=120))
    snapshot = index.read()
    assert snapshot.snapshot and [e.WhichOneof("event") for e in snapshot.events] == ["all_blocks_cleared"]

    tok = hf_tokenizer()
    prefix = tok(" ".join(f"Rule {i}: share the cache." for i in range(12)))["input_ids"]
    first = prefix + tok(" Question: what is rule 3?")["input_ids"]
    second = prefix + tok(" Question: which rule comes last?")["input_ids"]
    generate(colocated, first)
    generate(colocated, second)
    page = PAGE
    expected = {*block_hashes(first, page), *block_hashes(second, page)}
    shared = block_hashes(prefix, page)
    assert len(shared) >= 4 and set(block_hashes(first, page)) & set(block_hashes(second, page)) == set(
        shared
    )
    index.read_until(lambda: expected <= index.blocks)
    assert all(s.block_size == page for s in index.stored)
    stored_shared = [h for s in index.stored for h in s.block_hashes if h in shared]
    assert sorted(stored_shared) == sorted(shared)  # the shared prefix was stored once
    seen = index.seq

    assert stub.FlushCache(scheduler_pb2.FlushCacheRequest(), timeout=30).flushed
    index.read_until(lambda: not index.blocks)
    index.stream.cancel()
    assert_zmq_events_equal(zmq_sub, colocated.extra["kv_events_zmq"] + 1, index.batches[1:])

    # a consumer that saw batch `seen` reconnects: the batches it missed, then live ones
    incarnation = index.batches[-1].incarnation
    assert incarnation and {b.incarnation for b in index.batches} == {incarnation}
    request = scheduler_pb2.KVEventsRequest(from_seq=seen + 1, incarnation=incarnation)
    replay = Index(stub.SubscribeKVEvents(request, timeout=60))
    replay.seq = seen
    replay.read_until(lambda: replay.seq == index.seq)
    missed = [b for b in index.batches if b.seq > seen]
    assert [b.SerializeToString() for b in replay.batches] == [b.SerializeToString() for b in missed]
    assert any(e.WhichOneof("event") == "all_blocks_cleared" for b in missed for e in b.events)
    # another incarnation's seq (a restarted scheduler's) is not replayed: a snapshot instead
    request = scheduler_pb2.KVEventsRequest(from_seq=seen + 1, incarnation="an earlier process")
    other = stub.SubscribeKVEvents(request, timeout=60)
    assert next(other).snapshot
    other.cancel()
    replay.stream.cancel()
    channel.close()
