"""Staging pieces without NIXL: page gather/scatter, lanes, slot rings, notification messages."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.kv_transfer import KVTransferTimeout, StagingConfig, messages
from pdserve.kv_transfer.page_copy import PageCopier
from pdserve.kv_transfer.staging import SlotRing, StagingArea


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_then_scatter_moves_every_layer_of_each_page(dtype):
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(3, 2, 20, 4, 2, 8, generator=gen).to(dtype)
    dst = torch.zeros(3, 2, 30, 4, 2, 8, dtype=dtype)
    pages, targets = [7, 2, 19, 3], [0, 29, 11, 12]
    slot = torch.full((8 * src[:, :, 0].numel(),), float("nan"), dtype=dtype)
    nbytes = PageCopier(src).gather(pages, slot)
    assert nbytes == 4 * src[:, :, 0].numel() * src.element_size()
    assert torch.equal(slot[: 6 * 4 * 64].view(6, 4, 64), src.view(6, 20, 64)[:, pages])  # plane-major
    PageCopier(dst).scatter(slot, targets)
    expected = torch.zeros_like(dst)
    expected[:, :, targets] = src[:, :, pages]
    assert torch.equal(dst, expected)


def test_lanes_are_granted_once_per_key_until_none_is_left():
    pool = torch.zeros(2, 2, 10, 4, 2, 8)
    span = pool[:, :, 0].numel()
    area = StagingArea(pool, span, StagingConfig(slot_bytes=10, send_slots=2, lanes=2, lane_slots=3))
    assert area.pages_per_slot == 1 and area.slot_bytes == span * 4  # a slot holds at least one page
    a, b = area.lane_for("p0:1"), area.lane_for("p1:1")
    assert area.lane_for("p0:1") == a and a.first_slot == 2 and b.first_slot == 5 and a.slots == 3
    assert a.addr == area.addr(2) and area.slot(4).data_ptr() == area.addr(4)
    assert area.lane_for("p2:1") is None
    assert area.buffer.numel() == 8 * span


def test_slot_ring_waits_polls_and_refuses_strangers():
    ring = SlotRing(2)
    taken = {ring.acquire(time.monotonic() + 1), ring.acquire(time.monotonic() + 1)}
    assert taken == {0, 1}
    polls = []
    start = time.monotonic()
    with pytest.raises(KVTransferTimeout, match="no free slot"):
        ring.acquire(time.monotonic() + 0.05, poll=lambda: polls.append(1))
    assert time.monotonic() - start < 1 and len(polls) > 5
    assert ring.acquire(time.monotonic() + 1, poll=lambda: ring.release(1)) == 1
    assert ring.release(0) and not ring.release(0) and not ring.release(2)


def test_messages_round_trip_and_reject_strangers():
    tid = b"rid with spaces/3f"
    assert messages.parse(messages.landed(tid, 4, 3, 7)) == (messages.LANDED, messages.Landed(tid, 4, 3, 7))
    assert messages.parse(messages.landed(tid, 0, 1, messages.DIRECT))[1].slot == -1
    assert messages.parse(messages.ack(5)) == (messages.ACK, 5)
    assert messages.parse(messages.abort(tid)) == (messages.ABORT, tid)
    for bad in (b"", b"hello", b"L 1 2", b"A x", b"X"):
        with pytest.raises(ValueError):
            messages.parse(bad)
