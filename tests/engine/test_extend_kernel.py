"""The CPU extend-attention tile kernel against float64 PyTorch attention, and the backend's routing
of a mixed batch (tiles for extends, decode-kernel rows for decodes) against its SDPA path."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.layers.attention.cpu_extend_kernel import load_extend_kernel
from pdserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from pdserve.layers.radix_attention import RadixAttention
from pdserve.mem_cache.memory_pool import KVPool, ReqToTokenPool, slots_for_pages
from tests.engine.attention_reference import assert_matches, row_reference

# (cached prefix, new tokens): one-token and one-tile extends, tile boundaries (16, 17), a long
# cached prefix, a fresh 130-token prompt
REQUESTS = ((0, 1), (0, 5), (0, 16), (3, 17), (100, 31), (0, 130), (1000, 33))


def _has_avx512_bf16() -> bool:
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    return "avx512_bf16" in flags.split()


HAS_AVX512_BF16 = _has_avx512_bf16()
needs_avx512_bf16 = pytest.mark.skipif(not HAS_AVX512_BF16, reason="the tile kernel is AVX512_BF16 code")


def test_kernel_builds_exactly_where_the_cpu_has_avx512_bf16():
    """Elsewhere the backend runs extends on the decode kernel or SDPA (the tests below need it)."""
    assert (load_extend_kernel() is not None) == HAS_AVX512_BF16


@pytest.fixture(scope="module")
def kernel():
    kernel = load_extend_kernel()
    assert kernel is not None, "the CPU extend kernel did not build"
    return kernel


def make_batch(requests, num_heads, num_kv_heads, head_dim, page_size, seed=0):
    """Random bfloat16 K/V pages and queries for ``requests`` ((prefix, new) pairs), the queries in
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
    fused = torch.randn(row, width, generator=gen).to(torch.bfloat16)
    q = fused[:, : num_heads * head_dim].view(row, num_heads, head_dim)
    lens = torch.tensor(requests)
    pool = pool.bfloat16()
    return (
        q,
        pool[:, 0, 0],
        pool[:, 0, 1],
        page_table,
        lens[:, 0],
        lens[:, 1],
        torch.tensor(row_starts),
    )


@needs_avx512_bf16
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("page_size", [16, 7])
def test_ragged_extends_match_reference(kernel, head_dim, group, page_size):
    num_kv_heads = 2
    batch = make_batch(REQUESTS, group * num_kv_heads, num_kv_heads, head_dim, page_size)
    q, _, _, _, _, extend_lens, row_starts = batch
    scale = head_dim**-0.5
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    kernel(*batch, scale, out=out)
    expected = row_reference(*batch, scale)
    for row in range(q.shape[0]):
        if row in expected:
            assert_matches(out[row], expected[row])
        else:  # rows of no request (here: the spare row after each) are left alone
            assert bool((out[row] == 7.0).all())


@needs_avx512_bf16
def test_peaked_softmax(kernel):
    """Large scores: the running max moves block to block and one key dominates."""
    batch = make_batch(((40, 50), (0, 20)), 9, 3, 64, 16, seed=3)
    q = batch[0] * 30
    out = kernel(q, *batch[1:], 0.125)
    for row, expected in row_reference(q, *batch[1:], 0.125).items():
        assert_matches(out[row], expected)


@needs_avx512_bf16
def test_mixed_batch_routing_matches_sdpa(kernel):
    """A batch of decodes, cached-prefix extends and a fresh prompt: the backend runs the extends
    as tiles and the decodes as decode-kernel rows, and one layer's output equals its SDPA path's."""
    num_heads, num_kv_heads, head_dim, page_size = 9, 3, 64, 16
    config = SimpleNamespace(
        dtype=torch.bfloat16, num_local_heads=num_heads, num_local_kv_heads=num_kv_heads, head_dim=head_dim
    )
    runner = SimpleNamespace(
        device=torch.device("cpu"),
        model_config=config,
        kv_pool=KVPool(64, page_size, 1, num_kv_heads, head_dim, torch.bfloat16),
        req_to_token_pool=ReqToTokenPool(8, 1024),
    )
    tiles, sdpa = TorchNativeAttnBackend(runner), TorchNativeAttnBackend(runner, use_cpu_kernels=False)
    assert tiles.extend_kernel is not None
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
    layer = RadixAttention(num_heads, head_dim, head_dim**-0.5, num_kv_heads, 0)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).bfloat16()
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    outs = []
    for backend in (tiles, sdpa):
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
    assert tiles.tiles.extend_lens.tolist() == [31, 40, 17]
    assert tiles.tiles.row_starts.tolist() == [1, 32, 73]
    assert tiles.kernel_rows.token_index.tolist() == [0, 72] and tiles.kernel_rows.seq_lens.tolist() == [
        58,
        131,
    ]
    # both within bfloat16 rounding (2^-8 relative) of each other, on outputs of magnitude ~1
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2**-7, atol=2**-7)
