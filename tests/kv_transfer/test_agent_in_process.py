"""Two real NIXL agents in this process (UCX loopback): transfers, receives, peers and argument checks."""

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
    messages,
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
    decode.agent.add_peer(prefill.agent.local_info())
    yield prefill, decode
    prefill.agent.close()
    decode.agent.close()


async def test_random_pages_land_exactly(pair: tuple[Side, Side]):
    prefill, decode = pair
    gen = torch.Generator().manual_seed(0)
    src = torch.randperm(24, generator=gen)[:10].tolist()
    dst = torch.randperm(40, generator=gen)[:10].tolist()
    expected = decode.kv.clone()
    expected[dst] = prefill.kv[src]
    receive = decode.agent.expect(prefill.agent.name, b"rid-1", dst)
    nbytes = await prefill.agent.write_pages(decode.agent.name, src, dst, b"rid-1", timeout_s=10)
    assert await receive.wait(10) == nbytes == prefill.kv[src].numel() * prefill.kv.element_size()
    assert torch.equal(decode.kv, expected)


async def test_empty_transfers_complete_at_once(pair: tuple[Side, Side]):
    prefill, decode = pair
    before = decode.kv.clone()
    receive = decode.agent.expect(prefill.agent.name, b"all-cached", [])
    assert receive.done and await receive.wait(1) == 0
    assert await prefill.agent.write_pages(decode.agent.name, [], [], b"all-cached", timeout_s=5) == 0
    assert torch.equal(decode.kv, before)


async def test_a_receive_with_pages_missing_times_out_and_is_cancelled(pair: tuple[Side, Side]):
    prefill, decode = pair
    receive = decode.agent.expect(prefill.agent.name, b"half", [30, 31])
    transfer = prefill.agent.start_transfer(decode.agent.name, b"half", [30, 31], stall_s=5)
    transfer.send([3], 1)  # the first page never comes
    start = time.monotonic()
    with pytest.raises(KVTransferTimeout, match="1 of 2 pages missing"):
        await receive.wait(0.3)
    assert 0.3 <= time.monotonic() - start < 2
    transfer.finish()
    await transfer.wait(5)
    assert decode.agent.expect(prefill.agent.name, b"half", [30, 31]) is not receive  # the id is free again


async def test_landed_messages_count_each_page_once_and_only_from_the_sender(pair: tuple[Side, Side]):
    """A repeated LANDED, one out of range, or one from another agent never completes a receive."""
    prefill, decode = pair
    receive = decode.agent.expect(prefill.agent.name, b"forged", [5, 6])
    nixl = prefill.agent._agent
    for msg in (messages.landed(b"forged", 0, 1),) * 2 + (
        messages.landed(b"forged", 1, 5),
        messages.landed(b"forged", -1, 2),
    ):
        nixl.send_notif(decode.agent.name, msg)
    stranger = _side("stranger", 2, seed=5)
    try:
        stranger.agent.add_peer(decode.agent.local_info())
        stranger.agent._agent.send_notif(decode.agent.name, messages.landed(b"forged", 1, 1))
        await asyncio.sleep(0.3)
        assert not receive.done
        nixl.send_notif(decode.agent.name, messages.landed(b"forged", 1, 1))
        assert await receive.wait(5) == 2 * prefill.kv[0].numel() * prefill.kv.element_size()
    finally:
        stranger.agent.close()


async def test_bad_page_lists_and_unknown_peers_are_refused(pair: tuple[Side, Side]):
    prefill, decode = pair
    peer = decode.agent.name
    with pytest.raises(ValueError, match="destination page is outside"):
        await prefill.agent.write_pages(peer, [0], [40], b"x", timeout_s=1)
    with pytest.raises(ValueError, match="source page is outside"):
        await prefill.agent.write_pages(peer, [24], [0], b"x", timeout_s=1)
    with pytest.raises(ValueError, match="2 source pages but 1 destination"):
        await prefill.agent.write_pages(peer, [0, 1], [0], b"x", timeout_s=1)
    with pytest.raises(ValueError, match="more than once"):
        await prefill.agent.write_pages(peer, [0, 1], [3, 3], b"x", timeout_s=1)
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        prefill.agent.start_transfer(peer, b"x", [7, 8], stall_s=1).send([0, 1], 1)
    with pytest.raises(KVTransferError, match="unknown KV peer 'nobody'"):
        await prefill.agent.write_pages("nobody", [0], [0], b"x", timeout_s=1)
    decode.agent.expect(prefill.agent.name, b"twice", [1])
    with pytest.raises(KVTransferError, match="already expected"):
        decode.agent.expect(prefill.agent.name, b"twice", [1])


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
        KVTransferAgent("bad-shape", torch.zeros(2, 3, 2, 16, 3, 32, dtype=torch.bfloat16), LAYOUT)
    with pytest.raises(ValueError, match="contiguous"):
        kv = (
            torch.zeros(pool_shape(LAYOUT, 2), dtype=torch.bfloat16)
            .transpose(3, 4)
            .contiguous()
            .transpose(3, 4)
        )
        KVTransferAgent("strided", kv, LAYOUT)


async def test_close_fails_pending_receives():
    side = _side("closing", 2, seed=3)
    receive = side.agent.expect("someone", b"pending", [0, 1])
    waiter = asyncio.create_task(receive.wait(10))
    await asyncio.sleep(0.05)
    side.agent.close()
    with pytest.raises(KVTransferError, match="closed"):
        await waiter


def _swa_side(role: str, layout: KVLayout, pages: tuple[int, int], seed: int) -> tuple[KVTransferAgent, ...]:
    """An agent over a full pool and a local layers' pool (``SWAKVPool``'s two), random contents."""
    full = seeded_pool(
        dataclasses.replace(layout, num_layers=layout.num_layers - layout.num_local_layers), pages[0], seed
    )
    local = seeded_pool(dataclasses.replace(layout, num_layers=layout.num_local_layers), pages[1], seed + 1)
    return KVTransferAgent(f"{role}-{uuid.uuid4().hex[:8]}", full, layout, local), full, local


@pytest.mark.parametrize("num_local_layers", [2, 3], ids=["interleaved", "every-layer-local"])
async def test_both_page_spaces_of_an_swa_pool_land_exactly(num_local_layers):
    """A transfer into a decode worker's full pages and local-layer pages (the prompt's last window):
    each pool's pages land where named, byte counts per pool; with every layer local (Mistral) the
    full pages hold no KV and are not shipped. A side without a local pool is refused by name."""
    layout = dataclasses.replace(LAYOUT, num_local_layers=num_local_layers)
    (prefill, p_full, p_local), (decode, d_full, d_local) = (
        _swa_side("prefill", layout, (12, 7), seed=1),
        _swa_side("decode", layout, (20, 9), seed=5),
    )
    try:
        prefill.add_peer(decode.local_info())
        decode.add_peer(prefill.local_info())
        src, dst, src_local, dst_local = [3, 4, 5, 11], [0, 1, 2, 19], [2, 3], [0, 1]
        expected_full, expected_local = d_full.clone(), d_local.clone()
        expected_full[dst], expected_local[dst_local] = p_full[src], p_local[src_local]
        receive = decode.expect(prefill.name, b"swa", dst, dst_local)
        transfer = prefill.start_transfer(decode.name, b"swa", dst, 5, dst_local)
        if layout.page_bytes:
            transfer.send(src, 0)
        else:  # no full page is named: they hold no KV
            assert len(transfer.dst_pages) == 2
            with pytest.raises(ValueError, match="outside"):
                transfer.send(src, 0)
        transfer.send_local(src_local)
        transfer.finish()
        nbytes = await transfer.wait(10)
        assert await receive.wait(10) == nbytes == (p_full[src].numel() + p_local[src_local].numel()) * 2
        assert torch.equal(d_full, expected_full) and torch.equal(d_local, expected_local)
        assert transfer.descriptors == (3 if layout.page_bytes else 1)  # [3-5 -> 0-2], [11 -> 19], local
        with pytest.raises(ValueError, match="local pages for 2 local destinations"):
            prefill.start_transfer(decode.name, b"x", [], 5, dst_local).send_local([1])
        plain = KVTransferAgent(f"plain-{uuid.uuid4().hex[:8]}", seeded_pool(LAYOUT, 2, 0), LAYOUT)
        try:
            with pytest.raises(
                KVLayoutMismatch, match=r"num_local_layers: local \d, remote 0.*same --swa-full"
            ):
                decode.add_peer(plain.local_info())
        finally:
            plain.close()
    finally:
        prefill.close()
        decode.close()
