"""Page-run coalescing and descriptor addresses, checked against torch's own strides."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdserve.kv_transfer import KVAgentInfo, KVLayout, coalesce
from pdserve.kv_transfer.descriptors import page_run_descs

LAYOUT = KVLayout(model="m", dtype="float32", page_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


def test_contiguous_request_is_one_run():
    assert coalesce([0, 1, 2, 3], [10, 11, 12, 13]) == [(0, 10, 4)]


def test_runs_break_where_either_side_jumps():
    assert coalesce([0, 1, 2, 5, 6], [7, 8, 20, 21, 22]) == [(0, 7, 2), (2, 20, 1), (5, 21, 2)]


def test_pairs_are_ordered_by_source_before_merging():
    assert coalesce([5, 3, 4], [7, 5, 6]) == [(3, 5, 3)]


def test_empty_and_invalid_page_lists():
    assert coalesce([], []) == []
    with pytest.raises(ValueError, match="3 source pages but 2 destination"):
        coalesce([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="more than once"):
        coalesce([1, 2], [4, 4])


@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30, unique_by=lambda pair: pair[1])
)
def test_runs_cover_exactly_the_pairs_and_are_maximal(pairs: list[tuple[int, int]]):
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    runs = coalesce(src, dst)
    expanded = [(s + i, d + i) for s, d, n in runs for i in range(n)]
    assert sorted(expanded) == sorted(pairs)
    ordered = sorted(pairs)
    neighbours = zip(ordered, ordered[1:], strict=False)
    joins = sum(1 for (s0, d0), (s1, d1) in neighbours if s1 == s0 + 1 and d1 == d0 + 1)
    assert len(runs) == len(pairs) - joins


def test_descriptor_addresses_are_torch_page_addresses():
    num_pages = 7
    pool = torch.zeros(
        num_pages, LAYOUT.num_layers, 2, LAYOUT.page_size, LAYOUT.num_kv_heads, LAYOUT.head_dim
    )
    info = KVAgentInfo("a", b"", LAYOUT, pool.data_ptr(), pool.numel() * 4, -1, num_pages, "x")
    runs = coalesce([1, 2, 3, 6], [0, 1, 2, 5])  # (1, 0, 3), (6, 5, 1)
    starts = np.array([r[0] for r in runs])
    counts = np.array([r[2] for r in runs])
    descs = page_run_descs(info, starts, counts)
    assert descs.dtype == np.uint64 and descs.shape == (len(runs), 3)  # every layer's K and V in one
    expected = [
        (pool[start].data_ptr(), pool[start : start + n].numel() * 4, 0)
        for start, n in zip(starts, counts, strict=True)
    ]
    assert [tuple(int(x) for x in row) for row in descs] == expected


def test_runs_and_addresses_over_the_two_pools_of_an_swa_pool():
    """Transfer-space pages ``num_pages + q`` are page ``q`` of the local layers' pool (its own base
    and page bytes), and no run crosses from one pool into the other."""
    layout = KVLayout(**{**vars(LAYOUT), "num_local_layers": 2})
    full = torch.zeros(3, 1, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
    local = torch.zeros(4, 2, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
    info = KVAgentInfo(
        "a",
        b"",
        layout,
        full.data_ptr(),
        full.numel() * 4,
        -1,
        3,
        "x",
        local.data_ptr(),
        local.numel() * 4,
        4,
    )
    assert info.transfer_pages([2, 0], [1, 3]) == [2, 0, 4, 6]
    assert coalesce([2, 3, 4], [2, 3, 4], src_split=3, dst_split=3) == [(2, 2, 1), (3, 3, 2)]
    descs = page_run_descs(info, np.array([1, 4]), np.array([2, 3]))
    expected = [
        (full[1].data_ptr(), full[1:3].numel() * 4, 0),
        (local[1].data_ptr(), local[1:4].numel() * 4, 0),
    ]
    assert [tuple(int(x) for x in row) for row in descs] == expected
    no_full = KVAgentInfo(**{**vars(info), "layout": KVLayout(**{**vars(layout), "num_local_layers": 3})})
    assert no_full.transfer_pages([2, 0], [1]) == [4]  # every layer local: the full pages hold nothing
