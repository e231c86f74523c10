"""Head-sliced KV transfers between real NIXL agents in this process (UCX loopback): a group of two
prefill ranks into one decode rank and one prefill rank into a group of two, as ``head_map`` pairs
them; every head lands in its rank and offset, and a receive completes only once each sender's
slice of every page has landed."""

from __future__ import annotations

import uuid

import pytest
import torch

from pdserve.kv_transfer import KVFanout, KVTransferAgent, KVTransferError, KVTransferTimeout, head_map
from tests.kv_transfer.peer import seeded_pool
from tests.kv_transfer.test_head_map import group


def _agents(role: str, tp_size: int, num_pages: int, seed: int) -> list[tuple[KVTransferAgent, torch.Tensor]]:
    """One agent per rank over a pool of its heads, random contents (bfloat16)."""
    out = []
    for layout in group(tp_size, dtype="bfloat16"):
        pool = seeded_pool(layout, num_pages, seed + layout.tp_rank)
        out.append((KVTransferAgent(f"{role}{layout.tp_rank}-{uuid.uuid4().hex[:8]}", pool, layout), pool))
    return out


def _pair(prefill_tp: int, decode_tp: int):
    """Both groups' agents, each rank loaded with the peers ``head_map`` pairs it with; the routes and
    each decode rank's senders (agent -> heads it writes)."""
    prefill, decode = _agents("prefill", prefill_tp, 8, seed=1), _agents("decode", decode_tp, 12, seed=7)
    routes = head_map([a.layout for a, _ in decode], [a.layout for a, _ in prefill])
    senders: list[dict[str, int]] = [{} for _ in decode]
    for r in routes:
        (src, _), (dst, _) = prefill[r.src_rank], decode[r.dst_rank]
        src.add_peer(dst.local_info())
        dst.add_peer(src.local_info())
        senders[r.dst_rank][src.name] = r.heads.num_heads
    return prefill, decode, routes, senders


def _fanouts(prefill, decode, routes, tid: bytes, dst_pages: list[int]) -> list[KVFanout]:
    """Each prefill rank's transfers of one request (``KVSends.open``)."""
    fanouts = []
    for p, (agent, _) in enumerate(prefill):
        transfers = [
            agent.start_transfer(decode[r.dst_rank][0].name, tid, dst_pages, 5, (), r.heads)
            for r in routes
            if r.src_rank == p
        ]
        fanouts.append(KVFanout(transfers, len(dst_pages), 0))
    return fanouts


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
async def test_every_head_lands_in_its_rank_and_offset(prefill_tp, decode_tp):
    prefill, decode, routes, senders = _pair(prefill_tp, decode_tp)
    try:
        src_pages, dst_pages = [5, 2, 3], [0, 9, 10]
        whole = torch.cat([pool for _, pool in prefill], dim=4)  # [page, layer, kv, slot, head, dim]
        expected, start = [], 0
        for agent, pool in decode:
            want = pool.clone()
            want[dst_pages] = whole[src_pages][:, :, :, :, start : start + agent.layout.num_kv_heads]
            expected.append(want)
            start += agent.layout.num_kv_heads
        receives = [agent.expect(senders[d], b"t1", dst_pages) for d, (agent, _) in enumerate(decode)]
        fanouts = _fanouts(prefill, decode, routes, b"t1", dst_pages)
        for fanout in fanouts:  # in two groups, as a chunked prefill streams them
            fanout.send(src_pages[:1], 0)
            fanout.send(src_pages[1:], 1)
            fanout.finish()
        written = sum([await fanout.wait(5) for fanout in fanouts])
        landed = [await receive.wait(5) for receive in receives]
        assert written == sum(landed) == whole[src_pages].numel() * 2
        for (_, pool), want in zip(decode, expected, strict=True):
            assert torch.equal(pool, want)
        rows = 3 * 2 * 4  # layers x k/v x slots: one descriptor each per page
        assert all(t.descriptors == 3 * rows for f in fanouts for t in f.transfers)
    finally:
        for agent, _ in prefill + decode:
            agent.close()


async def test_a_receive_waits_for_every_sender():
    """Prefill TP=2 into decode TP=1: one rank's slices of every page do not complete the receive."""
    prefill, decode, routes, senders = _pair(2, 1)
    try:
        receive = decode[0][0].expect(senders[0], b"t", [1, 2])
        first, second = _fanouts(prefill, decode, routes, b"t", [1, 2])
        first.send([0, 1], 0)
        first.finish()
        assert await first.wait(5) > 0
        second.send([0], 0)  # the second rank's first page only
        with pytest.raises(KVTransferTimeout, match=r"[12] of 4 pages missing .*each of 2 senders"):
            await receive.wait(0.5)
        second.cancel()
    finally:
        for agent, _ in prefill + decode:
            agent.close()


async def test_one_sender_aborting_fails_the_receive():
    """Prefill TP=2 into decode TP=1: the second rank's transfer cancelled (its ABORT) fails the decode
    rank's receive although the first rank's slices all landed; a rank that writes nothing (a
    replicated head another rank writes) ends its write at once."""
    prefill, decode, routes, senders = _pair(2, 1)
    try:
        receive = decode[0][0].expect(senders[0], b"x", [4])
        first, second = _fanouts(prefill, decode, routes, b"x", [4])
        first.send([6], 0)
        first.finish()
        await first.wait(5)
        second.cancel()
        with pytest.raises(KVTransferError, match="aborted"):
            await receive.wait(5)
        nothing = KVFanout([], 1, 0)
        nothing.send([6], 0)
        nothing.finish()
        assert await nothing.wait(1) == 0
    finally:
        for agent, _ in prefill + decode:
            agent.close()
