"""The tokens of extends as rows of the CPU attention kernel (each its request's pages and its
position + 1 keys) against float64 PyTorch attention, and the backend's mixed batch (every token a
row) against its SDPA path."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.layers.attention.cpu_decode_kernel import load_decode_kernel
from pdserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from pdserve.layers.radix_attention import RadixAttention
from pdserve.mem_cache.memory_pool import KVPool, ReqToTokenPool, slots_for_pages
from tests.engine.attention_reference import assert_matches, hide_keys_before, row_reference

# (cached prefix, new tokens): one-token and one-tile extends, tile boundaries (16, 17), a long
# cached prefix, a fresh 130-token prompt
REQUESTS = ((0, 1), (0, 5), (0, 16), (3, 17), (100, 31), (0, 130), (1000, 33))


@pytest.fixture
def kernel(kernel_variant):
    kernel = load_decode_kernel()
    assert kernel is not None, "the CPU attention kernel did not build"
    return kernel


def as_rows(q, k_pages, v_pages, page_table, prefix_lens, extend_lens, row_starts):
    """The kernel's arguments for a batch of extends, each new token a row: the rows of ``q`` they
    are, then (queries, pages, page table, lengths) and each row's request."""
    rows = torch.cat([start + torch.arange(n) for start, n in zip(row_starts, extend_lens, strict=True)])
    row_req = torch.arange(len(extend_lens)).repeat_interleave(extend_lens)
    lens = torch.cat([p + 1 + torch.arange(n) for p, n in zip(prefix_lens, extend_lens, strict=True)])
    return rows, (q[rows], k_pages, v_pages, page_table, lens), row_req


def make_batch(requests, num_heads, num_kv_heads, head_dim, page_size, seed=0, dtype=torch.bfloat16):
    """Random ``dtype`` K/V pages and queries for ``requests`` ((prefix, new) pairs), the queries in
    strided rows of a fused qkv-like tensor with one spare row between requests. K/V are one layer's
    views of a page-major pool of two layers (``KVPool``'s layout). Slots no query may read (spare
    pages, last pages' tails, the other layer) hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    totals = [p + n for p, n in requests]
    pages_per = [-(-t // page_size) for t in totals]
    num_pages = sum(pages_per) + 2
    pool = torch.full((num_pages, 2, 2, page_size, num_kv_heads, head_dim), math.nan)
    k_pages, v_pages = pool[:, 0, 0], pool[:, 0, 1]
    order = torch.randperm(num_pages, generator=gen)
    page_table = torch.full((len(requests), max(pages_per)), int(order[-1]))
    row_starts, row, taken = [], 0, 0
    for r, total in enumerate(totals):
        own = order[taken : taken + pages_per[r]]
        taken += pages_per[r]
        page_table[r, : len(own)] = own
        slots = torch.arange(total)
        k_pages[own[slots // page_size], slots % page_size] = torch.randn(
            total, num_kv_heads, head_dim, generator=gen
        )
        v_pages[own[slots // page_size], slots % page_size] = torch.randn(
            total, num_kv_heads, head_dim, generator=gen
        )
        row_starts.append(row)
        row += requests[r][1] + 1
    width = (num_heads + 2 * num_kv_heads) * head_dim
    fused = torch.randn(row, width, generator=gen).to(dtype)
    q = fused[:, : num_heads * head_dim].view(row, num_heads, head_dim)
    lens = torch.tensor(requests)
    pool = pool.to(dtype)
    return (
        q,
        pool[:, 0, 0],
        pool[:, 0, 1],
        page_table,
        lens[:, 0],
        lens[:, 1],
        torch.tensor(row_starts),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("page_size", [16, 7])
def test_ragged_extends_match_reference(kernel, dtype, head_dim, group, page_size):
    num_kv_heads = 2
    batch = make_batch(REQUESTS, group * num_kv_heads, num_kv_heads, head_dim, page_size, dtype=dtype)
    scale = head_dim**-0.5
    rows, args, row_req = as_rows(*batch)
    out = kernel(*args, scale, row_req=row_req)
    expected = row_reference(*batch, scale)
    for i, row in enumerate(rows.tolist()):
        assert_matches(out[i], expected[row])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("window", [1, 5, 16, 17, 64])
def test_sliding_window_extends(kernel, dtype, head_dim, window):
    """Each token's row attends its own key and the ``window - 1`` before it: windows that start in
    different blocks, windows shorter than a block and longer than a prompt. The keys no
    query of a request may see (before its first query's window) are NaN and never read."""
    batch = make_batch(REQUESTS, 6, 2, head_dim, 16, seed=5, dtype=dtype)
    q, k_pages, v_pages, table, prefix_lens, extend_lens, row_starts = batch
    hide_keys_before(k_pages, v_pages, table, (prefix_lens + 1 - window).clamp_min(0))
    rows, args, row_req = as_rows(*batch)
    out = kernel(*args, 0.125, row_req=row_req, window=window)
    expected = row_reference(*batch, 0.125, window)
    for i, row in enumerate(rows.tolist()):
        assert_matches(out[i], expected[row])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaked_softmax(kernel, dtype):
    """Large scores: the running max moves block to block and one key dominates."""
    q, *rest = make_batch(((40, 50), (0, 20)), 9, 3, 64, 16, seed=3, dtype=dtype)
    q = q * 30
    rows, args, row_req = as_rows(q, *rest)
    out = kernel(*args, 0.125, row_req=row_req)
    largest_score = 64 * q.float().abs().max() * rest[0].float().nan_to_num().abs().max() * 0.125
    expected = row_reference(q, *rest, 0.125)
    for i, row in enumerate(rows.tolist()):
        assert_matches(out[i], expected[row], score_bound=float(largest_score))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 20])
def test_mixed_batch_rows_match_sdpa(kernel, dtype, window):
    """A batch of decodes, cached-prefix extends and a fresh prompt: the backend runs every token as a
    kernel row, and one layer's output equals its SDPA path's, with full attention and with a
    sliding window."""
    num_heads, num_kv_heads, head_dim, page_size = 9, 3, 64, 16
    config = SimpleNamespace(
        dtype=dtype, num_local_heads=num_heads, num_local_kv_heads=num_kv_heads, head_dim=head_dim
    )
    runner = SimpleNamespace(
        device=torch.device("cpu"),
        model_config=config,
        kv_pool=KVPool(64, page_size, 1, num_kv_heads, head_dim, dtype),
        req_to_token_pool=ReqToTokenPool(8, 1024),
    )
    layer = RadixAttention(num_heads, head_dim, head_dim**-0.5, num_kv_heads, 0, sliding_window=window)
    runner.model = torch.nn.Sequential(layer)  # the backend reads its layers' windows
    rows, sdpa = TorchNativeAttnBackend(runner), TorchNativeAttnBackend(runner, use_cpu_kernels=False)
    assert rows.decode_kernel is not None
    gen = torch.Generator().manual_seed(0)
    runner.kv_pool.kv_data.copy_(torch.randn(runner.kv_pool.kv_data.shape, generator=gen))
    requests = ((57, 1), (200, 31), (0, 40), (130, 1), (16, 17))  # (cached prefix, new tokens)
    next_page = 0
    for slot, (prefix, n) in enumerate(requests):
        pages = list(range(next_page, next_page + -(-(prefix + n) // page_size)))
        next_page += len(pages)
        runner.req_to_token_pool.req_to_token[slot, : len(pages) * page_size] = slots_for_pages(
            pages, 0, len(pages) * page_size, page_size
        )
    tokens = sum(n for _, n in requests)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    outs = []
    for backend in (rows, sdpa):
        runner.attn_backend = backend
        fb = ForwardBatch.init_new(
            input_ids=[0] * tokens,
            req_pool_indices=list(range(len(requests))),
            seq_lens=[p + n for p, n in requests],
            extend_prefix_lens=[p for p, _ in requests],
            runner=runner,
        )
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, layer, fb).view(tokens, num_heads, head_dim))
    kernel_rows = rows.kernel_rows
    assert kernel_rows.row_req.tolist() == [r for r, (_, n) in enumerate(requests) for _ in range(n)]
    assert kernel_rows.seq_lens.tolist() == [p + 1 + i for p, n in requests for i in range(n)]
    # float32: arithmetic rounding apart; bfloat16: within its rounding (2^-8 relative) of each other,
    # on outputs of magnitude ~1
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=tolerance, atol=tolerance)
