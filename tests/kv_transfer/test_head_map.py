"""Pairing prefill and decode ranks of different TP sizes by KV heads, and head-slice descriptors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pdserve.distributed.sharding import head_shard
from pdserve.kv_transfer import HeadRoute, HeadSlice, KVAgentInfo, KVLayout, KVLayoutMismatch, head_map
from pdserve.kv_transfer.descriptors import head_slice_descs

BASE = KVLayout(model="m", dtype="float32", page_size=4, num_layers=3, num_kv_heads=4, head_dim=8)


def group(tp_size: int, num_kv_heads: int = 4, num_heads: int = 8, **fields) -> list[KVLayout]:
    """Every rank's layout of a TP group, heads split as the model shards them (``head_shard``)."""
    layouts = []
    for rank in range(tp_size):
        shard = head_shard(num_heads, num_kv_heads, tp_size, rank)
        layouts.append(
            dataclasses.replace(
                BASE, num_kv_heads=shard.num_kv_heads, kv_head_start=shard.kv_start,
                total_kv_heads=num_kv_heads, tp_size=tp_size, tp_rank=rank, **fields,
            )
        )  # fmt: skip
    return layouts


def test_equal_sizes_pair_rank_i_with_rank_i_by_whole_pages():
    assert head_map(group(2), group(2)) == [HeadRoute(0, 0, None), HeadRoute(1, 1, None)]
    assert head_map(group(1), group(1)) == [HeadRoute(0, 0, None)]


def test_prefill_tp2_into_decode_tp1_writes_each_half():
    assert head_map(group(1), group(2)) == [
        HeadRoute(0, 0, HeadSlice(src_head=0, dst_head=0, num_heads=2)),
        HeadRoute(1, 0, HeadSlice(src_head=0, dst_head=2, num_heads=2)),
    ]


def test_prefill_tp1_into_decode_tp2_writes_both_ranks():
    assert head_map(group(2), group(1)) == [
        HeadRoute(0, 0, HeadSlice(src_head=0, dst_head=0, num_heads=2)),
        HeadRoute(0, 1, HeadSlice(src_head=2, dst_head=0, num_heads=2)),
    ]


def test_uneven_split_of_three_heads():
    """SmolLM2's 3 KV heads: TP=2 holds 2 and 1."""
    assert head_map(group(1, 3, 9), group(2, 3, 9)) == [
        HeadRoute(0, 0, HeadSlice(0, 0, 2)),
        HeadRoute(1, 0, HeadSlice(0, 2, 1)),
    ]
    assert head_map(group(2, 3, 9), group(1, 3, 9)) == [
        HeadRoute(0, 0, HeadSlice(0, 0, 2)),
        HeadRoute(0, 1, HeadSlice(2, 0, 1)),
    ]


def test_replicated_heads_are_written_once_each():
    """One KV head over 2 ranks (replicated): each decode rank gets it once, from its own index when
    that rank holds it, else from the lowest rank holding it."""
    assert head_map(group(2, 1, 2), group(2, 1, 2)) == [HeadRoute(0, 0, None), HeadRoute(1, 1, None)]
    assert head_map(group(1, 1, 2), group(2, 1, 2)) == [HeadRoute(0, 0, None)]  # rank 1 writes nothing
    assert head_map(group(2, 1, 2), group(1, 1, 2)) == [HeadRoute(0, 0, None), HeadRoute(0, 1, None)]
    # 2 heads over 4 decode ranks (each replicated twice) from 2 prefill ranks
    assert head_map(group(4, 2, 4), group(2, 2, 4)) == [
        HeadRoute(0, 0, None), HeadRoute(0, 1, None), HeadRoute(1, 2, None), HeadRoute(1, 3, None),
    ]  # fmt: skip


@pytest.mark.parametrize("decode_tp", [1, 2, 4])
@pytest.mark.parametrize("prefill_tp", [1, 2, 4])
def test_every_decode_head_is_written_exactly_once(decode_tp, prefill_tp):
    decode, prefill = group(decode_tp), group(prefill_tp)
    written = {d: [] for d in range(decode_tp)}
    for route in head_map(decode, prefill):
        src, dst = prefill[route.src_rank], decode[route.dst_rank]
        heads = route.heads or HeadSlice(0, 0, dst.num_kv_heads)
        global_src = [src.kv_head_start + heads.src_head + i for i in range(heads.num_heads)]
        global_dst = [dst.kv_head_start + heads.dst_head + i for i in range(heads.num_heads)]
        assert global_src == global_dst
        written[route.dst_rank] += global_dst
    assert all(sorted(written[d]) == list(decode[d].kv_heads) for d in written)


def test_a_geometry_difference_is_refused_naming_both_sides():
    with pytest.raises(KVLayoutMismatch) as err:
        head_map(group(1), group(2, head_dim=16))
    text = str(err.value)
    assert "head_dim: decode 8, prefill 16" in text
    assert "decode TP=1 holds KV heads [0, 4); prefill TP=2 holds [0, 2), [2, 4)" in text


def test_different_model_heads_are_refused():
    with pytest.raises(KVLayoutMismatch, match=r"total_kv_heads: decode 4, prefill 2 \(decode TP=1"):
        head_map(group(1), group(1, 2, 8))


def test_a_head_no_prefill_rank_holds_is_refused():
    prefill = [dataclasses.replace(group(2)[0], tp_size=1)]  # heads [0, 2) of 4 only
    with pytest.raises(KVLayoutMismatch, match=r"KV head 2 of decode rank 0 is held by no prefill rank"):
        head_map(group(1), prefill)


def test_ranks_out_of_order_are_refused():
    with pytest.raises(KVLayoutMismatch, match="prefill ranks are not 0..tp_size-1"):
        head_map(group(2), group(2)[::-1])
    bad = [dataclasses.replace(group(1)[0], kv_head_start=2)]
    with pytest.raises(KVLayoutMismatch, match="decode rank 0 holds KV heads the model lacks"):
        head_map(bad, group(1))


def test_different_sizes_with_a_local_layers_pool_are_refused():
    assert head_map(group(2, num_local_layers=1), group(2, num_local_layers=1)) == [
        HeadRoute(0, 0, None), HeadRoute(1, 1, None),
    ]  # fmt: skip
    with pytest.raises(KVLayoutMismatch, match=r"local layers' pool.*use equal TP sizes \(decode TP=1"):
        head_map(group(1, num_local_layers=1), group(2, num_local_layers=1))


def _info(layout: KVLayout, pool: torch.Tensor) -> KVAgentInfo:
    nbytes = pool.numel() * pool.element_size()
    return KVAgentInfo("a", b"", layout, pool.data_ptr(), nbytes, -1, pool.shape[0], "x")


@pytest.mark.parametrize(("head", "num_heads"), [(0, 1), (1, 2), (0, 4), (3, 1)])
def test_head_slice_descriptors_address_exactly_the_slice(head, num_heads):
    """Each descriptor is one (page, layer, kv, slot) row's slice, in page then row order, and the
    bytes they cover are exactly the tensor's ``[pages, :, :, :, head:head + n]``."""
    pool = torch.arange(6 * 3 * 2 * 4 * 4 * 8, dtype=torch.float32).reshape(6, 3, 2, 4, 4, 8)
    info = _info(BASE, pool)
    pages = np.array([4, 1], dtype=np.int64)
    descs = head_slice_descs(info, pages, head, num_heads)
    assert descs.shape == (2 * 3 * 2 * 4, 3)
    assert (descs[:, 1] == num_heads * 8 * 4).all() and (descs[:, 2] == 0).all()
    flat = pool.reshape(-1)
    got = torch.stack([flat[(int(a) - pool.data_ptr()) // 4 :][: num_heads * 8] for a in descs[:, 0]])
    expected = pool[pages.tolist(), :, :, :, head : head + num_heads].reshape(-1, num_heads * 8)
    assert torch.equal(got, expected)
