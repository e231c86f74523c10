"""A KV-event consumer for the stack tests: a worker's cache index built from its events alone."""

from __future__ import annotations

import grpc

from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc


class Index:
    """A consumer's view of one worker's cache, built from its KV events alone."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.blocks: set[int] = set()
        self.stored: list[scheduler_pb2.BlockStored] = []
        self.batches: list[scheduler_pb2.KVEventBatch] = []
        self.seq = 0

    def read(self) -> scheduler_pb2.KVEventBatch:
        batch = next(self.stream)
        assert batch.snapshot or batch.seq == self.seq + 1, "live batches arrive in order, none skipped"
        self.seq = batch.seq
        self.batches.append(batch)
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "block_stored":
                stored = event.block_stored
                assert stored.medium == "device"
                if stored.HasField("parent_block_hash"):
                    assert stored.parent_block_hash in self.blocks
                self.blocks.update(stored.block_hashes)
                self.stored.append(stored)
            elif kind == "block_removed":
                self.blocks.difference_update(event.block_removed.block_hashes)
            else:
                self.blocks.clear()
        return batch

    def read_until(self, done) -> None:
        while not done():
            self.read()


def snapshot_blocks(address: str, service: str) -> set[int]:
    """The block hashes of a fresh subscription's snapshot from the ``service`` ("DecodeScheduler" or
    "PrefillScheduler") scheduler at ``address``."""
    with grpc.insecure_channel(address) as channel:
        stub = getattr(scheduler_pb2_grpc, f"{service}Stub")(channel)
        index = Index(stub.SubscribeKVEvents(scheduler_pb2.KVEventsRequest(), timeout=30))
        assert index.read().snapshot
        index.stream.cancel()
    return index.blocks
