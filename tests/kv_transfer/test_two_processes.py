"""Real NIXL between two processes (UCX over loopback): exact bytes written into random page lists,
chunked sends, failures injected mid-transfer, hung/dead/restarted peers."""

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
from pdserve.kv_transfer.sender import KVSender
from tests.kv_transfer.peer import LAYOUT, NUM_PAGES, seeded_pool, start_peer

SRC_PAGES = 48  # prefill's pool is smaller than decode's, so base/num_pages mix-ups show
DECODE_SEED = 2
PAGE = LAYOUT.page_bytes  # one page of every layer, K and V


@pytest.fixture(scope="module")
def decode():
    peer = start_peer(f"decode-{uuid.uuid4().hex[:8]}", seed=DECODE_SEED)
    yield peer, seeded_pool(LAYOUT, NUM_PAGES, seed=DECODE_SEED)  # the peer's pool as it should be
    peer.stop()


@pytest.fixture(scope="module")
def prefill(decode):
    """The sending agent and its pool, known to the decode peer."""
    peer, _ = decode
    kv = seeded_pool(LAYOUT, SRC_PAGES, seed=1)
    agent = KVTransferAgent(f"prefill-{uuid.uuid4().hex[:8]}", kv, LAYOUT)
    agent.add_peer(peer.info)
    assert peer.ask("add_peer", agent.local_info()) == "ok"
    yield agent, kv
    agent.close()


def _tid() -> bytes:
    return f"rid-{uuid.uuid4().hex}".encode()


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
    tid = _tid()
    assert peer.ask("expect", agent.name, tid, dst) == "ok"
    nbytes = asyncio.run(agent.write_pages(peer.info.agent_name, src, dst, tid, timeout_s=10))
    assert nbytes == len(src) * PAGE
    assert peer.ask("wait", tid, 10) == nbytes
    expected[dst] = kv[src]
    assert torch.equal(peer.pool(), expected)


async def test_chunks_sent_as_they_are_ready_complete_only_with_the_last(prefill, decode):
    agent, kv = prefill
    peer, expected = decode
    kv.normal_()
    src, dst = list(range(30, 46)), [63 - 3 * i for i in range(16)]
    tid = _tid()
    assert peer.ask("expect", agent.name, tid, dst) == "ok"
    transfer = agent.start_transfer(peer.info.agent_name, tid, dst, stall_s=10)
    transfer.send(src[8:], 8)  # any order: pages are matched by their index in dst
    transfer.send(src[:5], 0)
    await asyncio.sleep(0.3)
    assert peer.ask("done", tid) is False
    transfer.send(src[5:8], 5)
    transfer.finish()
    with pytest.raises(ValueError, match="after finish"):
        transfer.send(src[:1], 0)
    assert await transfer.wait(10) == 16 * PAGE
    assert transfer.descriptors == 16  # no two consecutive destination pages: one per page
    assert peer.ask("wait", tid, 10) == 16 * PAGE
    expected[dst] = kv[src]
    assert torch.equal(peer.pool(), expected)


async def test_failure_mid_transfer_corrupts_nothing_and_the_next_transfer_lands(
    prefill, decode, monkeypatch
):
    """The third of four groups of a transfer fails at its WRITE: the sender fails, the receiver is
    told at once and never completes, no page outside the destination changes, and the next
    transfer into the same pages lands whole."""
    agent, kv = prefill
    peer, expected = decode
    real, calls = KVSender._post, []

    def failing(self, group):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected post failure")
        return real(self, group)

    kv.normal_()
    src, dst = list(range(12)), list(range(40, 52))
    tid = _tid()
    assert peer.ask("expect", agent.name, tid, dst) == "ok"
    monkeypatch.setattr(KVSender, "_post", failing)
    transfer = agent.start_transfer(peer.info.agent_name, tid, dst, stall_s=10)
    for first in range(0, 12, 3):
        transfer.send(src[first : first + 3], first)
    transfer.finish()
    with pytest.raises(KVTransferError, match="injected post failure"):
        await transfer.wait(10)
    monkeypatch.undo()
    assert "aborted" in peer.ask("wait", tid, 10)
    landed = peer.pool()
    outside = [p for p in range(NUM_PAGES) if p not in dst]
    assert torch.equal(landed[outside], expected[outside])
    expected[dst] = landed[dst]  # undefined bytes there: the decode side frees these pages

    kv.normal_()
    tid = _tid()
    assert peer.ask("expect", agent.name, tid, dst + [0, 1, 2, 3, 4, 5]) == "ok"
    src = list(range(18))
    await agent.write_pages(peer.info.agent_name, src, dst + [0, 1, 2, 3, 4, 5], tid, timeout_s=10)
    assert peer.ask("wait", tid, 10) == 18 * PAGE
    expected[dst + [0, 1, 2, 3, 4, 5]] = kv[src]
    assert torch.equal(peer.pool(), expected)


async def test_a_cancelled_receive_never_completes(prefill, decode):
    """A receive cancelled before its pages come never completes (its LANDED counts for nothing)."""
    agent, kv = prefill
    peer, expected = decode
    kv.normal_()
    tid = _tid()
    assert peer.ask("expect", agent.name, tid, list(range(10))) == "ok"
    assert peer.ask("cancel", tid) == "ok"  # e.g. the request was aborted on the decode side
    await agent.write_pages(peer.info.agent_name, range(10), range(10), tid, timeout_s=10)
    assert "cancelled" in peer.ask("wait", tid, 10)


async def test_peer_that_hangs_dies_and_restarts(prefill):
    """Hung: a write times out on time, cancelling aborts it. Dead: writes fail in well under a second
    and it cannot be re-added. Restarted under the same name: the new incarnation replaces it."""
    agent, kv = prefill
    name = f"mortal-{uuid.uuid4().hex[:8]}"
    first = start_peer(name, seed=3)
    second = None
    try:
        agent.add_peer(first.info)
        assert first.ask("add_peer", agent.local_info()) == "ok"
        first.signal(signal.SIGSTOP)  # alive but making no progress
        start = time.monotonic()
        with pytest.raises(KVTransferTimeout, match="timed out|stalled"):
            await agent.write_pages(name, range(SRC_PAGES), range(SRC_PAGES), _tid(), timeout_s=0.5)
        assert 0.5 <= time.monotonic() - start < 2.5
        task = asyncio.create_task(agent.write_pages(name, [0], [0], _tid(), 30))
        await asyncio.sleep(0.1)
        task.cancel()  # e.g. the request was aborted: the transfer is aborted with it
        with pytest.raises(asyncio.CancelledError):
            await task

        first.signal(signal.SIGKILL)
        first.process.join()
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="disconnected|failed|unknown KV peer"):
            await agent.write_pages(name, [1], [1], _tid(), timeout_s=30)
        assert not agent.has_peer(name)
        with pytest.raises(KVTransferError, match="cannot add KV peer"):
            agent.add_peer(first.info)  # nothing listens at its address any more
        assert time.monotonic() - start < 5

        second = start_peer(name, seed=4)
        agent.add_peer(second.info)
        assert second.ask("add_peer", agent.local_info()) == "ok"
        assert agent.has_peer(name, second.info.incarnation)
        kv.normal_()
        tid = _tid()
        assert second.ask("expect", agent.name, tid, [9, 10, 20, 30]) == "ok"
        await agent.write_pages(name, [5, 6, 7, 8], [9, 10, 20, 30], tid, 10)
        assert second.ask("wait", tid, 10) == 4 * PAGE
        expected = seeded_pool(LAYOUT, NUM_PAGES, seed=4)
        expected[[9, 10, 20, 30]] = kv[[5, 6, 7, 8]]
        assert torch.equal(second.pool(), expected)
    finally:
        agent.remove_peer(name)
        for peer in (first, second):
            if peer is not None:
                peer.stop()
