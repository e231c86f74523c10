"""The CPU extend-attention tile kernel against float64 PyTorch attention, and the backend's routing
of a mixed batch (tiles for extends, decode-kernel rows for decodes) against its SDPA path."""

from __future__ import annotations

import math
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


@pytest.fixture
def kernel(kernel_variant):
    kernel = load_extend_kernel()
    assert kernel is not None, "the CPU extend kernel did not build"
    return kernel


def test_kernel_supports_float32_and_bfloat16_head_dims_in_steps_of_8(kernel):
    """Every variant builds it (the lane kernel; AVX512_BF16 adds the pair kernel for bfloat16)."""
    for dtype in (torch.float32, torch.bfloat16):
        assert all(kernel.supports(dtype, d) for d in (8, 64, 80, 128, 256, 512))
        assert not any(kernel.supports(dtype, d) for d in (0, 36, 520))
    assert not kernel.supports(torch.float16, 64)


def test_refuses_what_it_cannot_run(kernel):
    batch = make_batch(((0, 5),), 4, 2, 36, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="head_dim 36"):
        kernel(*batch, 0.125)
    q, k_pages, v_pages, *rest = make_batch(((0, 5),), 4, 2, 64, 16, dtype=torch.float32)
    with pytest.raises(TypeError, match="all float32 or all bfloat16"):
        kernel(q.bfloat16(), k_pages, v_pages, *rest, 0.125)


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
    """head_dim 64 and 128 run the pair kernel for bfloat16 on AVX512_BF16, 80 the lane kernel."""
    num_kv_heads = 2
    batch = make_batch(REQUESTS, group * num_kv_heads, num_kv_heads, head_dim, page_size, dtype=dtype)
    q, _, _, _, _, extend_lens, row_starts = batch
    scale = head_dim**-0.5
    out = torch.full(q.shape, 7.0, dtype=dtype)
    kernel(*batch, scale, out=out)
    expected = row_reference(*batch, scale)
    for row in range(q.shape[0]):
        if row in expected:
            assert_matches(out[row], expected[row])
        else:  # rows of no request (here: the spare row after each) are left alone
            assert bool((out[row] == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaked_softmax(kernel, dtype):
    """Large scores: the running max moves block to block and one key dominates."""
    batch = make_batch(((40, 50), (0, 20)), 9, 3, 64, 16, seed=3, dtype=dtype)
    q = batch[0] * 30
    out = kernel(q, *batch[1:], 0.125)
    largest_score = 64 * q.float().abs().max() * batch[1].float().nan_to_num().abs().max() * 0.125
    for row, expected in row_reference(q, *batch[1:], 0.125).items():
        assert_matches(out[row], expected, score_bound=float(largest_score))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_routing_matches_sdpa(kernel, dtype):
    """A batch of decodes, cached-prefix extends and a fresh prompt: the backend runs the extends
    as tiles and the decodes as decode-kernel rows, and one layer's output equals its SDPA path's."""
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
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
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
    # float32: arithmetic rounding apart; bfloat16: within its rounding (2^-8 relative) of each other,
    # on outputs of magnitude ~1
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=tolerance, atol=tolerance)
