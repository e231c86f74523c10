"""The CPU decode-attention kernel against plain float64 PyTorch attention on random paged pools."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.layers.attention.cpu_decode_kernel import load_decode_kernel
from tests.engine.attention_reference import assert_matches, hide_keys_before, reference

RAGGED = (1, 15, 16, 17, 33, 100, 257)  # one key, around page boundaries, not multiples of the page


@pytest.fixture
def kernel(kernel_variant):
    kernel = load_decode_kernel()
    assert kernel is not None, "the CPU decode kernel did not build"
    return kernel


def make_pool(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    q_scale: float = 1.0,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """q, K/V pages, a shuffled page table and seq lens. K/V are one layer's views of a page-major pool
    of two layers (``KVPool``'s layout: pages strided). Every slot no request may read (spare pages,
    the page table's padding page, a last page's tail, the other layer) holds NaN, so reading one shows
    in the output."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(seq_lens)
    pages_per = (lens + page_size - 1) // page_size
    num_pages = int(pages_per.sum()) + 3
    pool = torch.full((num_pages, 2, 2, page_size, num_kv_heads, head_dim), math.nan)
    k_pages, v_pages = pool[:, 1, 0], pool[:, 1, 1]
    order = torch.randperm(num_pages, generator=gen)
    padding = int(order[-1])  # like the backend, padding entries point at a real page: never read
    page_table = torch.full((len(seq_lens), int(pages_per.max())), padding)
    taken = 0
    for b, n in enumerate(seq_lens):
        own = order[taken : taken + int(pages_per[b])]
        taken += len(own)
        page_table[b, : len(own)] = own
        slots = torch.arange(n)
        rows, cols = own[slots // page_size], slots % page_size
        k_pages[rows, cols] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v_pages[rows, cols] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen) * q_scale
    pool = pool.to(dtype)
    return q.to(dtype), pool[:, 1, 0], pool[:, 1, 1], page_table, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7])
def test_ragged_batch_matches_reference(kernel, dtype, head_dim, group):
    num_kv_heads = 2
    q, k, v, table, lens = make_pool(list(RAGGED), group * num_kv_heads, num_kv_heads, head_dim, 16, dtype)
    scale = head_dim**-0.5
    out = kernel(q, k, v, table, lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert_matches(out, reference(q, k, v, table, lens, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "page_size"), [(80, 5), (256, 32), (64, 1)])
def test_other_head_dims_and_page_sizes(kernel, dtype, head_dim, page_size):
    """head_dim 80 runs the portable C path, 256 the widest AVX-512 one; pages of 5 and 1 tokens."""
    q, k, v, table, lens = make_pool([3, 40, 129], 12, 3, head_dim, page_size, dtype)
    out = kernel(q, k, v, table, lens, head_dim**-0.5)
    assert_matches(out, reference(q, k, v, table, lens, head_dim**-0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows_split_at_fixed_positions_alike_on_any_thread_count(kernel, dtype):
    """A row's keys are split every 512 positions whatever the batch or the threads (the splits of
    a long row run in parallel, then merge in order): the output is the same bit for bit."""
    q, k, v, table, lens = make_pool([3001, 40], 9, 3, 64, 16, dtype)
    expected = reference(q, k, v, table, lens, 0.125)
    whole = kernel(q, k, v, table, lens, 0.125, num_threads=1)
    assert_matches(whole, expected)
    for threads in (2, 4):
        assert torch.equal(kernel(q, k, v, table, lens, 0.125, num_threads=threads), whole)
    assert torch.equal(kernel(q[:1], k, v, table[:1], lens[:1], 0.125, num_threads=2), whole[:1])


def test_peaked_softmax(kernel):
    """Large logits (a max that keeps growing, weights underflowing to 0) stay exact in float32."""
    q, k, v, table, lens = make_pool([700, 65, 2], 8, 2, 128, 16, torch.float32, q_scale=8.0, seed=1)
    out = kernel(q, k, v, table, lens, 1.0)
    assert_matches(out, reference(q, k, v, table, lens, 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_query_rows(kernel, dtype):
    """q rows read in place from a fused qkv tensor (row stride > Hq * D) give the same output."""
    q, k, v, table, lens = make_pool([5, 70, 300], 9, 3, 64, 16, dtype, seed=2)
    qkv = torch.full((3, 9 * 64 + 2 * 3 * 64), math.nan, dtype=dtype)
    qkv[:, : 9 * 64] = q.reshape(3, -1)
    strided = qkv[:, : 9 * 64].view(3, 9, 64)
    assert not strided.is_contiguous()
    out = kernel(strided, k, v, table, lens, 0.125)
    torch.testing.assert_close(out, kernel(q, k, v, table, lens, 0.125), rtol=0, atol=0)
    assert_matches(out, reference(q, k, v, table, lens, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("window", [1, 7, 16, 40, 4096])
def test_sliding_window_reads_only_the_last_keys(kernel, dtype, page_size, window):
    """A sliding-window layer's rows attend their last ``window`` keys; the keys before them (NaN
    here) are never read."""
    q, k, v, table, lens = make_pool(list(RAGGED), 8, 2, 64, page_size, dtype, seed=3)
    hide_keys_before(k, v, table, (lens - window).clamp_min(0))
    out = kernel(q, k, v, table, lens, 0.125, window=window)
    assert_matches(out, reference(q, k, v, table, lens, 0.125, window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_of_a_split_request(kernel, dtype):
    """With idle threads a long request's window is split over its positions as a whole one is."""
    q, k, v, table, lens = make_pool([3001, 40], 9, 3, 64, 16, dtype, seed=4)
    hide_keys_before(k, v, table, (lens - 1000).clamp_min(0))
    expected = reference(q, k, v, table, lens, 0.125, 1000)
    for threads in (1, 2, 4):
        assert_matches(kernel(q, k, v, table, lens, 0.125, num_threads=threads, window=1000), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cap", [0.0, 4.0])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [0, 40])
def test_soft_capping_and_sinks(kernel, dtype, cap, with_sinks, window):
    """Gemma 2's soft-capped scores and gpt-oss's attention sinks (one logit per head, some above
    every score, some below), with and without a window, over rows long enough to split (the sinks
    join the merge of the splits once)."""
    q, k, v, table, lens = make_pool([*RAGGED, 1100], 6, 2, 64, 16, dtype, q_scale=3.0, seed=6)
    sinks = torch.tensor([-3.0, 0.0, 0.5, 2.0, 6.0, 40.0]) if with_sinks else None
    out = kernel(q, k, v, table, lens, 0.125, window=window, cap=cap, sinks=sinks)
    expected = reference(q, k, v, table, lens, 0.125, window, cap, sinks)
    assert_matches(out, expected, score_bound=float(3.0 * 64 * 0.125 * 4))
