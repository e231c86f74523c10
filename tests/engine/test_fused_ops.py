"""The fused CPU ops against Hugging Face's own modules (LlamaRMSNorm, apply_rotary_pos_emb, SiLU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from pdserve.layers.activation import SiluAndMul
from pdserve.layers.cpu_fused_ops import load_fused_ops
from pdserve.layers.layernorm import RMSNorm
from pdserve.layers.rotary_embedding import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def ops(kernel_variant):
    ops = load_fused_ops()
    assert ops is not None, "the fused CPU ops did not build"
    return ops


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: summation order and exp/rsqrt implementations only; bfloat16: where those land a
    # value on the other side of a rounding boundary, up to two steps of 1/128 relative apart
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (1.6e-2, 1e-2)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_add_rmsnorm_matches_hf(ops, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    hidden = 576
    hf = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    hf.weight.data = torch.randn(hidden, generator=gen).to(dtype)
    ours = RMSNorm(hidden, eps=1e-5).to(dtype)
    ours.weight.data = hf.weight.data.clone()
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)

    assert_close(ours(x), hf(x), dtype)
    expected_sum = x + residual  # HF adds in the activation dtype
    out, new_residual = ours(x, residual.clone())
    assert torch.equal(new_residual, expected_sum)
    assert_close(out, hf(expected_sum), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_fused_qkv_matches_hf(ops, dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, hq, hk, d = 11, 9, 3, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rope = RotaryEmbedding(d, 4096, inv_freq)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q, k, _ = qkv.clone().split([hq * d, hk * d, hk * d], dim=-1)  # strided views, as in the model

    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    q_ref, k_ref = apply_rotary_pos_emb(
        q.reshape(tokens, hq, d).transpose(0, 1)[None],
        k.reshape(tokens, hk, d).transpose(0, 1)[None],
        emb.cos().to(dtype)[None],
        emb.sin().to(dtype)[None],
    )
    q_out, k_out = rope(positions, q, k)
    assert q_out.data_ptr() == q.data_ptr(), "rotated in place"
    assert_close(q_out.view(tokens, hq, d), q_ref[0].transpose(0, 1), dtype)
    assert_close(k_out.view(tokens, hk, d), k_ref[0].transpose(0, 1), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(ops, dtype):
    x = (torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    x[0, 0] = -200.0  # far tail of the sigmoid: 0, never NaN
    gate, up = x.chunk(2, dim=-1)
    out = SiluAndMul()(x)
    assert_close(out, F.silu(gate) * up, dtype)
    assert torch.isfinite(out).all() and abs(float(out[0, 0])) < 1e-20


@pytest.mark.parametrize(
    ("dtype", "pool_dtype"), [*((d, d) for d in DTYPES), (torch.float32, torch.bfloat16)]
)
@pytest.mark.parametrize("rows", [1, 9, 700])  # 700 rows of bfloat16 K/V: enough bytes to go parallel
def test_store_kv_from_fused_qkv_matches_index_put(ops, dtype, pool_dtype, rows):
    """Copied, or float32 rows rounded into a bfloat16 pool as ``Tensor.to`` rounds them."""
    gen = torch.Generator().manual_seed(rows)
    q_size, kv_size, slots = 9 * 64, 3 * 64, 2048
    qkv = torch.randn(rows, q_size + 2 * kv_size, generator=gen).to(dtype)
    _, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # strided views, as the model passes them
    loc = torch.randperm(slots, generator=gen)[:rows]
    page_size = 16  # layer 1 of a page-major pool of two layers, as KVPool lays it out
    pool = torch.zeros(slots // page_size, 2, 2, page_size, 3, 64, dtype=pool_dtype)
    assert ops.stores_kv(k, pool_dtype) and not ops.stores_kv(k.bfloat16(), torch.float32)
    ops.store_kv(k, v, pool[:, 1, 0], pool[:, 1, 1], loc)
    expected = torch.zeros_like(pool)
    expected[loc // page_size, 1, 0, loc % page_size] = k.reshape(rows, 3, 64).to(pool_dtype)
    expected[loc // page_size, 1, 1, loc % page_size] = v.reshape(rows, 3, 64).to(pool_dtype)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 5), (3, 49152), (64, 49152)])
def test_argmax_matches_torch_with_ties_and_minus_inf(ops, shape, dtype):
    gen = torch.Generator().manual_seed(shape[0])
    logits = torch.randn(shape, generator=gen).to(dtype)  # bfloat16: many ties among the values
    logits[:, : shape[1] // 2] = float("-inf")  # banned tokens (min_tokens, logit bias)
    top = logits.max(dim=-1, keepdim=True).values
    logits[:, -1:] = top  # a tie: the first index wins, as in torch.argmax
    assert torch.equal(ops.argmax(logits), logits.float().argmax(dim=-1))
    ties = torch.zeros(shape, dtype=dtype)  # every entry equal: index 0
    assert torch.equal(ops.argmax(ties), torch.zeros(shape[0], dtype=torch.int64))
