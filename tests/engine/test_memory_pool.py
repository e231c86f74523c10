"""Memory pools, the page→slot map, KV-pool sizing, and ForwardBatch construction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.mem_cache.memory_pool import (
    KVPool,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    num_pages_for_budget,
    slots_for_pages,
)


def test_allocator_hands_out_the_smallest_run_that_fits_else_the_longest_runs():
    alloc = PagedTokenToKVPoolAllocator(num_pages=20, page_size=16)
    held = alloc.alloc(20)
    alloc.free([1, 2, 5, 6, 7, 8, 12, 13, 14])  # free runs: [1, 2], [5, 8], [12, 14]
    assert alloc.alloc(3) == [12, 13, 14]  # best fit, not the first run of 3+ pages
    assert alloc.alloc(1) == [1]  # the smallest hole first
    assert alloc.alloc(5) == [2, 5, 6, 7, 8]  # no run holds 5: the longest first, then the next
    assert alloc.available_size() == 0 and len(held) == 20


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=60))
def test_allocator_never_hands_out_a_page_twice(ops):
    alloc = PagedTokenToKVPoolAllocator(num_pages=32, page_size=16)
    owned: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc or not owned:
            pages = alloc.alloc(n)
            if pages is None:
                assert n > alloc.available_size()
                continue
            assert len(pages) == n == len(set(pages)) and pages == sorted(pages)
            assert not set(pages) & {p for o in owned for p in o}
            owned.append(pages)
        else:
            alloc.free(owned.pop(n % len(owned)))
        assert alloc.available_size() == 32 - sum(map(len, owned))


def test_allocator_hands_out_lowest_pages_first_and_coalesces_after_free():
    alloc = PagedTokenToKVPoolAllocator(num_pages=10, page_size=4)
    a = alloc.alloc(3)
    b = alloc.alloc(4)
    assert a == [0, 1, 2] and b == [3, 4, 5, 6]
    assert alloc.available_size() == 3
    alloc.free(a)
    assert alloc.alloc(5) == [0, 1, 2, 7, 8]
    assert alloc.available_size() == 1
    assert alloc.alloc(2) is None  # short: nothing taken
    assert alloc.available_size() == 1
    assert alloc.alloc(0) == []


def test_allocator_rejects_double_free_and_foreign_pages_atomically():
    alloc = PagedTokenToKVPoolAllocator(num_pages=4, page_size=16)
    pages = alloc.alloc(2)
    alloc.free(pages[:1])
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(pages)  # pages[1] must not have been freed by the failed call
    assert alloc.available_size() == 3
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free([pages[1], pages[1]])
    with pytest.raises(ValueError, match="out of range"):
        alloc.free([4])
    alloc.free([pages[1]])
    assert alloc.available_size() == 4


def test_req_to_token_pool_slots():
    pool = ReqToTokenPool(size=2, max_context_len=8)
    assert pool.req_to_token.shape == (2, 8) and pool.req_to_token.dtype == torch.int64
    first, second = pool.alloc(), pool.alloc()
    assert {first, second} == {0, 1} and pool.alloc() is None
    pool.free(first)
    with pytest.raises(ValueError, match="twice"):
        pool.free(first)
    with pytest.raises(ValueError, match="out of range"):
        pool.free(2)
    assert pool.available_size() == 1 and pool.alloc() == first


def test_slots_for_pages_maps_positions_through_pages():
    pages = [7, 2, 5]
    expected = [pages[p // 4] * 4 + p % 4 for p in range(3, 10)]
    assert slots_for_pages(pages, 3, 10, page_size=4).tolist() == expected
    assert slots_for_pages(pages, 0, 0, page_size=4).tolist() == []
    with pytest.raises(ValueError):
        slots_for_pages(pages, 0, 13, page_size=4)


def test_kv_pool_is_page_major_with_strided_layer_views():
    pool = KVPool(num_pages=6, page_size=4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    assert pool.kv_data.shape == (6, 3, 2, 4, 2, 8) and pool.kv_data.is_contiguous()
    assert pool.page_nbytes == 3 * 2 * 4 * 2 * 8 * 2  # every layer's K and V of 4 tokens
    loc = torch.tensor([5, 17])  # page 1 offset 1, page 4 offset 1
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    pool.set_kv(1, loc, k, v)
    assert torch.equal(pool.kv_data[1, 1, 0, 1], k[0].bfloat16())
    assert torch.equal(pool.kv_data[4, 1, 1, 1], v[1].bfloat16())
    k_pages, v_pages = pool.kv_pages(1)
    assert k_pages.shape == v_pages.shape == (6, 4, 2, 8)
    assert torch.equal(k_pages[4, 1], k[1].bfloat16()) and torch.equal(v_pages[1, 1], v[0].bfloat16())
    assert k_pages.stride(0) == v_pages.stride(0) == pool.page_stride == 3 * 2 * 4 * 2 * 8
    assert k_pages[0].is_contiguous()
    # page p of every layer is one contiguous byte range, page p + 1 right after it
    start = pool.kv_data[3].data_ptr()
    assert pool.kv_data[4].data_ptr() - start == pool.page_nbytes
    assert pool.kv_pages(2)[1][3].data_ptr() - start == (2 * 2 + 1) * 4 * 2 * 8 * 2


def test_pool_sizing_from_tokens_or_bytes():
    per_token = KVPool.bytes_per_token(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    assert per_token == 30 * 2 * 3 * 64 * 4
    assert num_pages_for_budget(16, per_token, max_total_tokens=1000) == 62
    assert num_pages_for_budget(16, per_token, kv_cache_memory=per_token * 16 * 5 + 1) == 5
    with pytest.raises(ValueError, match="at least one"):
        num_pages_for_budget(16, per_token, max_total_tokens=8)
    with pytest.raises(ValueError, match="give"):
        num_pages_for_budget(16, per_token)


class _Runner:
    """What ForwardBatch.init_new reads from a ModelRunner."""

    device = torch.device("cpu")
    req_to_token_pool = kv_pool = attn_backend = None


def test_forward_batch_derives_positions_lengths_and_mode():
    fb = ForwardBatch.init_new(
        input_ids=[11, 12, 13, 21, 31, 32],
        req_pool_indices=[0, 1, 2],
        seq_lens=[3, 9, 6],
        extend_prefix_lens=[0, 8, 4],
        out_cache_loc=list(range(6)),
        runner=_Runner(),
    )
    assert fb.forward_mode is ForwardMode.EXTEND and fb.batch_size == 3
    assert fb.positions.tolist() == [0, 1, 2, 8, 4, 5]
    assert fb.extend_seq_lens.tolist() == [3, 1, 2]
    decode = ForwardBatch.init_new(
        input_ids=[1, 2],
        req_pool_indices=[0, 1],
        seq_lens=[5, 7],
        extend_seq_lens=[1, 1],
        out_cache_loc=[4, 6],
        runner=_Runner(),
    )
    assert decode.forward_mode is ForwardMode.DECODE and decode.extend_prefix_lens.tolist() == [4, 6]
    assert decode.positions.tolist() == [4, 6]
    with pytest.raises(ValueError, match="inconsistent"):
        ForwardBatch.init_new(
            input_ids=[1, 2],
            req_pool_indices=[0],
            seq_lens=[3],
            extend_prefix_lens=[0],
            out_cache_loc=[0, 1],
            runner=_Runner(),
        )
    with pytest.raises(ValueError, match="one token per request"):
        ForwardBatch.init_new(
            input_ids=[1, 2],
            req_pool_indices=[0],
            seq_lens=[2],
            extend_prefix_lens=[0],
            out_cache_loc=[0, 1],
            runner=_Runner(),
            forward_mode=ForwardMode.DECODE,
        )
