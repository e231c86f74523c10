"""KV events in vLLM's ZMQ wire format: a real radix cache's events through ``KVEventPublisher`` and
the ZMQ publisher on a loopback port, read by a SUB consumer that decodes them with msgspec structs
written from vLLM's schema (``tests/kv_events_vllm.py``); replay; the flags' bounds."""

from __future__ import annotations

import argparse

import msgspec
import pytest
import zmq

from pdserve.mem_cache.block_hash import block_hashes
from pdserve.mem_cache.kv_events import KVEventPublisher
from pdserve.mem_cache.memory_pool import PagedTokenToKVPoolAllocator
from pdserve.mem_cache.radix_cache import RadixCache
from pdserve.services.common.kv_events_zmq import ZmqKVEventPublisher
from pdserve.services.common.kv_events_zmq_args import add_kv_events_args, kv_events_flags
from pdserve.services.common.scheduler_main import kv_events_zmq
from pdserve.services.launcher.main import make_parser as launcher_parser
from pdserve.services.launcher.topology import build_topology
from tests.kv_events_vllm import DECODER, TIMEOUT_MS, BlockRemoved, BlockStored, apply, replay


def test_a_vllm_consumer_rebuilds_the_cache_and_replays_what_it_missed():
    page = 2
    cache = RadixCache(PagedTokenToKVPoolAllocator(6, page), page)
    events = KVEventPublisher(cache.snapshot_events)
    cache.set_event_sink(events.record)
    zmq_pub = ZmqKVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv@w0")
    events.listeners.append(zmq_pub.publish)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.connect(zmq_pub.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@w0")

        def step(tokens: list[int]) -> None:
            prefix = cache.match_prefix(tokens).page_indices
            new = cache.allocator.alloc(len(tokens) // page - len(prefix))
            if new is None:  # the pool is short: evict (BlockRemoved), as the scheduler does
                cache.evict(len(tokens) // page - len(prefix) - cache.allocator.available_size())
                new = cache.allocator.alloc(len(tokens) // page - len(prefix))
            cache.insert(tokens, [*prefix, *new])
            events.flush()

        step([1, 2, 3, 4, 5, 6])  # batch 1, likely before the SUB joined: replayed below
        for k in range(200):  # more steps until the SUB has joined (ZMQ's slow joiner)
            if sub.poll(50):
                break
            step([30 + k, 30 + k])
        else:
            pytest.fail("the SUB socket never received a batch")
        for tokens in ([1, 2, 3, 4, 9, 9], [7, 7, 8, 8], [1, 2, 5, 5]):
            step(tokens)
        cache.reset()
        events.flush()
        step([4, 4, 3, 3, 2, 2])
        step([4, 4, 3, 3, 1, 1])
        last = events.seq
        received: dict[int, bytes] = {}
        while not received or max(received) < last:
            assert sub.poll(TIMEOUT_MS), "every batch is published"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@w0" and len(seq) == 8
            received[int.from_bytes(seq, "big")] = payload
        first_live = min(received)
        assert sorted(received) == list(range(first_live, last + 1)), "live: in order, no gaps once joined"
        missed = replay(zmq_pub.replay_endpoint, 1)  # what a consumer does on a gap: replay from there
        assert [seq for seq, _ in missed] == list(range(1, last + 1)), "replay from 1: every batch held"
        assert all(received[seq] == payload for seq, payload in missed if seq >= first_live)
        payloads = [payload for seq, payload in missed if seq < first_live] + [
            received[s] for s in sorted(received)
        ]
        batches = [DECODER.decode(payload) for payload in payloads]
        blocks: set[int] = set()
        for batch in batches:
            apply(blocks, batch)

        tree = {h for e in cache.snapshot_events() for h in e.block_hashes}
        assert blocks == tree
        a, b, c = block_hashes([1, 2, 3, 4, 5, 6], page)
        assert batches[0].events == [BlockStored([a, b, c], None, [1, 2, 3, 4, 5, 6], page, None, "GPU")]
        raw = msgspec.msgpack.decode(payloads[0])  # the documented wire layout, untyped
        stored = ["BlockStored", [a, b, c], None, [1, 2, 3, 4, 5, 6], page, None, "GPU"]
        assert raw == [batches[0].ts, [stored], None]
        assert blocks == set(block_hashes([4, 4, 3, 3, 2, 2], page)) | set(
            block_hashes([4, 4, 3, 3, 1, 1], page)
        )
        assert any(isinstance(e, BlockRemoved) for batch in batches for e in batch.events), "evictions"
        assert [seq for seq, _ in replay(zmq_pub.replay_endpoint, last - 1)] == [last - 1, last]
        assert replay(zmq_pub.replay_endpoint, last + 1) == []
    finally:
        sub.close(linger=0)
        zmq_pub.close()


def test_bad_endpoints_are_clear_start_up_errors():
    parser = argparse.ArgumentParser()
    add_kv_events_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-events-endpoint", "http://127.0.0.1:5557"])
    taken = ZmqKVEventPublisher("tcp://127.0.0.1:*")
    try:
        args = parser.parse_args(["--kv-events-endpoint", taken.endpoint.replace("127.0.0.1", "*")])
        with pytest.raises(SystemExit, match="--kv-events-endpoint .*Address already in use"):
            kv_events_zmq(args)
        with pytest.raises(ValueError, match="Invalid argument|No such device|Invalid"):
            ZmqKVEventPublisher("tcp://*:notaport")
    finally:
        taken.close()
    with pytest.raises(SystemExit, match="needs --kv-events-endpoint"):
        kv_events_zmq(parser.parse_args(["--kv-events-replay-endpoint", "tcp://*:5558"]))
    assert kv_events_zmq(parser.parse_args([])) is None


def test_the_launcher_gives_each_scheduler_its_own_ports():
    argv = ["--num-prefill", "1", "--num-decode", "2", "--kv-events-endpoint", "tcp://*:5557"]
    specs = build_topology(
        launcher_parser().parse_args([*argv, "--kv-events-replay-endpoint", "ipc:///tmp/r"]), "/m"
    )
    flags = {
        s.name: s.argv[s.argv.index("--kv-events-endpoint") :]
        for s in specs
        if s.role in ("prefill", "decode")
    }
    assert flags["prefill-0"][:4] == [
        "--kv-events-endpoint",
        "tcp://*:5557",
        "--kv-events-replay-endpoint",
        "ipc:///tmp/r",
    ]
    assert flags["decode-1"][:4] == [
        "--kv-events-endpoint",
        "tcp://*:5559",
        "--kv-events-replay-endpoint",
        "ipc:///tmp/r_dp2",
    ]
    assert "--kv-events-endpoint" not in specs[-1].argv
    assert kv_events_flags(launcher_parser().parse_args([]), 3) == []
