"""Two real NIXL agents in this process (UCX loopback): writes, notifications, peers and argument checks."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import pytest
import torch

from pdserve.kv_transfer import (
    KVLayout,
    KVLayoutMismatch,
    KVTransferAgent,
    KVTransferError,
    KVTransferTimeout,
)
from tests.kv_transfer.peer import pool_shape, seeded_pool

LAYOUT = KVLayout(
    model="test-model", dtype="bfloat16", page_size=16, num_layers=3, num_kv_heads=3, head_dim=64
)


@dataclasses.dataclass
class Side:
    agent: KVTransferAgent
    kv: torch.Tensor


def _side(role: str, num_pages: int, seed: int) -> Side:
    kv = seeded_pool(LAYOUT, num_pages, seed)
    return Side(KVTransferAgent(f"{role}-{uuid.uuid4().hex[:8]}", kv, LAYOUT), kv)


@pytest.fixture(scope="module")
def pair():
    prefill, decode = _side("prefill", 24, seed=1), _side("decode", 40, seed=2)
    prefill.agent.add_peer(decode.agent.local_info())
    yield prefill, decode
    prefill.agent.close()
    decode.agent.close()


async def test_random_pages_land_exactly_and_notify(pair: tuple[Side, Side]):
    prefill, decode = pair
    gen = torch.Generator().manual_seed(0)
    src = torch.randperm(24, generator=gen)[:10].tolist()
    dst = torch.randperm(40, generator=gen)[:10].tolist()
    expected = decode.kv.clone()
    expected[:, :, dst] = prefill.kv[:, :, src]
    waiter = asyncio.create_task(decode.agent.wait_for_notification(b"rid-1", timeout_s=10))
    nbytes = await prefill.agent.write_pages(decode.agent.name, src, dst, notif=b"rid-1", timeout_s=10)
    await waiter
    assert nbytes == prefill.kv[:, :, src].numel() * prefill.kv.element_size()
    assert torch.equal(decode.kv, expected)


async def test_notification_that_came_first_is_kept_for_its_waiter(pair: tuple[Side, Side]):
    prefill, decode = pair
    await prefill.agent.write_pages(decode.agent.name, [0], [0], notif=b"early", timeout_s=10)
    await prefill.agent.write_pages(decode.agent.name, [1], [1], notif=b"unclaimed", timeout_s=10)
    await asyncio.sleep(0.2)
    await decode.agent.wait_for_notification(b"early", timeout_s=1)
    assert decode.agent.poll_notifications() == [b"unclaimed"]
    assert decode.agent.poll_notifications() == []


async def test_empty_page_list_only_notifies(pair: tuple[Side, Side]):
    prefill, decode = pair
    before = decode.kv.clone()
    nbytes = await prefill.agent.write_pages(decode.agent.name, [], [], notif=b"all-cached", timeout_s=5)
    await decode.agent.wait_for_notification(b"all-cached", timeout_s=5)
    assert nbytes == 0 and torch.equal(decode.kv, before)


async def test_waiting_for_a_missing_notification_times_out(pair: tuple[Side, Side]):
    _, decode = pair
    start = time.monotonic()
    with pytest.raises(KVTransferTimeout, match="did not arrive"):
        await decode.agent.wait_for_notification(b"never-sent", timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 2


async def test_bad_page_lists_and_unknown_peers_are_refused(pair: tuple[Side, Side]):
    prefill, decode = pair
    peer = decode.agent.name
    with pytest.raises(ValueError, match="destination page is outside"):
        await prefill.agent.write_pages(peer, [0], [40], notif=b"x", timeout_s=1)
    with pytest.raises(ValueError, match="source page is outside"):
        await prefill.agent.write_pages(peer, [24], [0], notif=b"x", timeout_s=1)
    with pytest.raises(ValueError, match="2 source pages but 1 destination"):
        await prefill.agent.write_pages(peer, [0, 1], [0], notif=b"x", timeout_s=1)
    with pytest.raises(KVTransferError, match="unknown KV peer 'nobody'"):
        await prefill.agent.write_pages("nobody", [0], [0], notif=b"x", timeout_s=1)


def test_peer_bookkeeping(pair: tuple[Side, Side]):
    prefill, decode = pair
    info = decode.agent.local_info()
    assert prefill.agent.has_peer(info.agent_name, info.incarnation)
    assert not prefill.agent.has_peer(info.agent_name, "another-incarnation")
    prefill.agent.add_peer(info)  # same incarnation: no-op
    assert prefill.agent.has_peer(info.agent_name)
    with pytest.raises(KVTransferError, match="own name"):
        prefill.agent.add_peer(dataclasses.replace(info, agent_name=prefill.agent.name))


def test_layout_mismatch_is_refused_with_the_differing_fields(pair: tuple[Side, Side]):
    prefill, _ = pair
    other = dataclasses.replace(LAYOUT, page_size=32, num_layers=2)
    kv = torch.zeros(pool_shape(other, 4), dtype=torch.bfloat16)
    stranger = KVTransferAgent(f"stranger-{uuid.uuid4().hex[:8]}", kv, other)
    try:
        with pytest.raises(
            KVLayoutMismatch, match="page_size: local 16, remote 32; num_layers: local 3, remote 2"
        ):
            prefill.agent.add_peer(stranger.local_info())
        assert not prefill.agent.has_peer(stranger.name)
    finally:
        stranger.close()


def test_pool_must_match_its_layout():
    with pytest.raises(ValueError, match="dtype"):
        KVTransferAgent("bad-dtype", torch.zeros(pool_shape(LAYOUT, 2)), LAYOUT)
    with pytest.raises(ValueError, match="shape"):
        KVTransferAgent("bad-shape", torch.zeros(3, 2, 2, 16, 3, 32, dtype=torch.bfloat16), LAYOUT)
    with pytest.raises(ValueError, match="contiguous"):
        kv = (
            torch.zeros(pool_shape(LAYOUT, 2), dtype=torch.bfloat16)
            .transpose(3, 4)
            .contiguous()
            .transpose(3, 4)
        )
        KVTransferAgent("strided", kv, LAYOUT)


async def test_close_fails_pending_waiters():
    side = _side("closing", 2, seed=3)
    waiter = asyncio.create_task(side.agent.wait_for_notification(b"pending", timeout_s=10))
    await asyncio.sleep(0.05)
    side.agent.close()
    with pytest.raises(KVTransferError, match="closed"):
        await waiter
