"""Real NIXL between two processes (UCX over loopback): exact bytes, notifications, hung/dead peers."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer import KVTransferAgent, KVTransferError, KVTransferTimeout
from tests.kv_transfer.peer import LAYOUT, NUM_PAGES, seeded_pool, start_peer

SRC_PAGES = 48  # prefill's pool is smaller than decode's, so base/num_pages mix-ups show
DECODE_SEED = 2


@pytest.fixture(scope="module")
def prefill():
    kv = seeded_pool(LAYOUT, SRC_PAGES, seed=1)
    agent = KVTransferAgent(f"prefill-{uuid.uuid4().hex[:8]}", kv, LAYOUT)
    yield agent, kv
    agent.close()


@pytest.fixture(scope="module")
def decode(prefill):
    peer = start_peer(f"decode-{uuid.uuid4().hex[:8]}", seed=DECODE_SEED)
    prefill[0].add_peer(peer.info)
    yield peer, seeded_pool(LAYOUT, NUM_PAGES, seed=DECODE_SEED)  # the peer's pool as it should be
    peer.stop()


def _page_pairs(max_pages: int):
    n = st.integers(0, max_pages)
    return n.flatmap(
        lambda k: st.tuples(
            st.permutations(range(SRC_PAGES)).map(lambda p: p[:k]),
            st.permutations(range(NUM_PAGES)).map(lambda p: p[:k]),
        )
    )


@settings(max_examples=12, deadline=None)
@given(pages=_page_pairs(max_pages=40))
def test_random_page_lists_land_exactly(prefill, decode, pages):
    agent, kv = prefill
    peer, expected = decode
    src, dst = list(pages[0]), list(pages[1])
    kv.normal_()  # fresh bytes every example, so a stale page cannot pass
    notif = f"rid-{uuid.uuid4().hex}".encode()
    write = agent.begin_write(peer.info.agent_name, src, dst, notif, timeout_s=10)  # the sync driver
    while not write.poll():
        time.sleep(0.0005)
    assert write.nbytes == kv[:, :, src].numel() * kv.element_size()
    assert peer.ask("wait", notif, 10) == "ok"
    expected[:, :, dst] = kv[:, :, src]
    assert torch.equal(peer.pool(), expected)


async def test_write_pages_contiguous_request_and_poll(prefill, decode):
    agent, kv = prefill
    peer, expected = decode
    kv.normal_()
    nbytes = await agent.write_pages(peer.info.agent_name, range(8, 24), range(30, 46), b"contiguous", 10)
    assert nbytes == kv[:, :, 8:24].numel() * kv.element_size()
    deadline = time.monotonic() + 5
    got: list[bytes] = []
    while not got and time.monotonic() < deadline:
        got = peer.ask("poll")
    assert got == [b"contiguous"]
    expected[:, :, 30:46] = kv[:, :, 8:24]
    assert torch.equal(peer.pool(), expected)


async def test_peer_that_hangs_dies_and_restarts(prefill):
    """Hung: the write times out on time, cancelling aborts it. Dead: writes fail in well under a
    second and it cannot be re-added. Restarted under the same name: the new incarnation replaces it."""
    agent, kv = prefill
    name = f"mortal-{uuid.uuid4().hex[:8]}"
    first = start_peer(name, seed=3)
    second = None
    try:
        agent.add_peer(first.info)
        first.signal(signal.SIGSTOP)  # alive but making no progress
        start = time.monotonic()
        with pytest.raises(KVTransferTimeout, match="timed out"):
            await agent.write_pages(name, range(SRC_PAGES), range(SRC_PAGES), b"late", timeout_s=0.5)
        assert 0.5 <= time.monotonic() - start < 2.5
        task = asyncio.create_task(agent.write_pages(name, [0], [0], b"cancelled", 30))
        await asyncio.sleep(0.1)
        task.cancel()  # e.g. the request was aborted: the transfer is aborted with it
        with pytest.raises(asyncio.CancelledError):
            await task
        write = agent.begin_write(name, [1], [1], b"released", 30)
        write.release()
        with pytest.raises(KVTransferError, match="aborted"):
            write.poll()

        first.signal(signal.SIGKILL)
        first.process.join()
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="disconnected|failed"):
            await agent.write_pages(name, [1], [1], b"after-crash", timeout_s=30)
        with pytest.raises(KVTransferError, match="cannot add KV peer"):
            agent.add_peer(first.info)  # nothing listens at its address any more
        assert time.monotonic() - start < 5
        assert not agent.has_peer(name)

        second = start_peer(name, seed=4)
        agent.add_peer(second.info)
        assert agent.has_peer(name, second.info.incarnation)
        kv.normal_()
        await agent.write_pages(name, [5, 6], [9, 10], b"after-restart", 10)
        assert second.ask("wait", b"after-restart", 10) == "ok"
        expected = seeded_pool(LAYOUT, NUM_PAGES, seed=4)
        expected[:, :, [9, 10]] = kv[:, :, [5, 6]]
        assert torch.equal(second.pool(), expected)
    finally:
        agent.remove_peer(name)
        for peer in (first, second):
            if peer is not None:
                peer.stop()
