"""The bfloat16 CPU matmul kernel against float32 / float64 matmuls of the same values.

The kernel runs on CPUs with AVX512_BF16 and AVX512_VNNI: in the ``avx512bf16`` variant on vector
instructions, and in the ``amx`` variant (CPUs with AMX) with AMX tiles for bfloat16 weights whose
``K`` is a multiple of 32. Every test here runs on each of those variants this CPU can execute;
elsewhere ``linear`` uses oneDNN and only the selection tests below apply.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from pdserve.distributed import SINGLE_RANK
from pdserve.engine.model_runner import ModelRunner
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.cpu_gemm import PanelWeight, load_cpu_gemm
from pdserve.layers.linear import Linear, OneDNNWeight, prepack_weight
from pdserve.layers.native import cpu_has, forced_variant, kernel_library, runnable_variants
from pdserve.models.llama import LlamaMLP

# the variants this CPU runs that hold the kernel: gated on what the CPU can execute, not on what
# the default configuration picks
GEMM_VARIANTS = [v for v in runnable_variants() if kernel_library(v).gemm_supported()]


def test_the_kernel_runs_exactly_where_the_cpu_supports_it():
    assert bool(GEMM_VARIANTS) == (cpu_has("avx512_bf16") and cpu_has("avx512_vnni"))
    assert [v for v in runnable_variants() if v in ("amx", "avx512bf16")] == GEMM_VARIANTS
    assert (load_cpu_gemm() is not None) == bool(GEMM_VARIANTS)  # a failed build on such a CPU fails here


@pytest.fixture(scope="module", params=GEMM_VARIANTS)
def gemm(request):
    """The kernel of each variant that has it, that variant selected for the test."""
    with forced_variant(request.param):
        yield load_cpu_gemm()


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 products and sums of the bfloat16 inputs, rounded once to bfloat16."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(torch.bfloat16)


def assert_matches(actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    expected = reference(x, weight, bias)
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    # the same float32 sum in another order: at most one bfloat16 rounding step apart
    scale = F.linear(x.float().abs(), weight.float().abs()).to(torch.bfloat16).float()
    assert ((actual.float() - expected.float()).abs() <= scale * 2**-8 + 1e-6).all()


# rows: 1, a partial tile, a full tile, one row past it, a 64-row block and a partial second block
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 64, 130])
@pytest.mark.parametrize(("out_features", "in_features"), [(32, 2), (96, 576), (960, 576), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float32_matmul(gemm, rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    packed = gemm.pack(weight)
    assert packed.data.shape == (out_features // 32, in_features // 2, 32, 2)
    assert_matches(packed.matmul(x, bias), x, weight, bias)


def test_strided_rows_leading_dims_and_no_rows(gemm):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    packed = gemm.pack(weight)
    wide = torch.randn(11, 200, generator=gen).to(torch.bfloat16)
    x = wide[:, 40:168]  # row stride 200: a slice of a fused projection's output
    assert_matches(packed.matmul(x), x, weight, None)
    batched = torch.randn(3, 5, 128, generator=gen).to(torch.bfloat16)
    out = packed.matmul(batched)
    assert out.shape == (3, 5, 64)
    assert_matches(out.reshape(15, 64), batched.reshape(15, 128), weight, None)
    assert packed.matmul(torch.empty(0, 128, dtype=torch.bfloat16)).shape == (0, 64)
    with pytest.raises(TypeError, match="bfloat16 activations"):
        packed.matmul(torch.randn(2, 128))
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        packed.matmul(x, None, torch.float16)


def test_linear_packs_for_the_kernel_where_the_shape_allows(gemm):
    layer = Linear(576, 960).to(torch.bfloat16)
    layer.weight.data.normal_()
    layer.process_weights_after_loading()
    assert isinstance(layer.packed, PanelWeight)
    x = torch.randn(4, 576).to(torch.bfloat16)
    assert_matches(layer(x), x, layer.weight, None)
    # 48 output features is not a whole number of panels: oneDNN's packed weight, bit for bit
    odd = torch.randn(48, 576).to(torch.bfloat16)
    fallback = prepack_weight(odd)
    assert isinstance(fallback, OneDNNWeight)
    assert torch.equal(fallback.matmul(x), F.linear(x, odd))
    assert prepack_weight(odd.float()) is None  # float32 stays on MKL


@pytest.mark.parametrize("rows", [1, 9, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_halves_layout_and_silu_epilogue(gemm, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    size, hidden = 96, 64  # a merged [gate; up] weight of 2 x 96 rows
    weight = torch.randn(2 * size, hidden, generator=gen).to(torch.bfloat16)
    bias = torch.randn(2 * size, generator=gen).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    plain = gemm.pack(weight)
    halves = plain.to_halves()
    gate_up = plain.matmul(x, bias)
    assert torch.equal(halves.matmul(x, bias), gate_up)
    # the epilogue rounds where the separate bfloat16 ops round: the same values as the fused
    # SiLU-and-mul op on the matmul's output (its own tests compare it with Hugging Face's SiLU)
    assert torch.equal(halves.silu_and_mul(x, bias), SiluAndMul()(gate_up))
    with pytest.raises(ValueError, match="halves"):
        plain.silu_and_mul(x)


def test_mlp_folds_silu_into_the_gate_up_matmul(gemm):
    config = LlamaConfig(hidden_size=64, intermediate_size=96, hidden_act="silu")
    mlp = LlamaMLP(config, SINGLE_RANK).to(torch.bfloat16)
    for param in mlp.parameters():
        param.data.normal_(std=0.1)
    x = torch.randn(5, 64).to(torch.bfloat16)
    for module in (mlp.gate_up_proj, mlp.down_proj, mlp):  # children first, as the loader does
        module.process_weights_after_loading()
    assert mlp.fused_act is mlp.gate_up_proj.packed and mlp.fused_act.halves
    # the same kernel's [gate | up] through the separate SiLU-and-mul op (F.linear would be oneDNN's
    # kernel: AMX tiles or not, as oneDNN decides, so not this kernel's sums bit for bit)
    assert torch.equal(mlp(x), mlp.down_proj(SiluAndMul()(mlp.gate_up_proj(x))))
    assert_matches(mlp.gate_up_proj(x), x, mlp.gate_up_proj.weight, None)  # still [gate | up]


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 150),
    panels=st.integers(1, 5),
    steps=st.integers(1, 80),
    extra_stride=st.integers(0, 9),
    with_bias=st.booleans(),
    halves=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_shape_matches_the_reference(gemm, rows, panels, steps, extra_stride, with_bias, halves, seed):
    """Random shapes (rows across tiles and blocks, panels split over threads), row strides, biases,
    and layouts against float64 matmuls of the same bfloat16 values; bfloat16 and float32 outputs."""
    gen = torch.Generator().manual_seed(seed)
    n, k = 32 * panels, 2 * steps  # steps: pairs of input features, as the panels hold them
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, k + extra_stride, generator=gen).to(torch.bfloat16)[:, :k]
    packed = gemm.pack(weight)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if halves:
        packed = packed.to_halves()
    out = packed.matmul(x, bias)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    # one bfloat16 rounding of the result (plus float32 summation order for bfloat16 inputs)
    magnitude = F.linear(x.double().abs(), weight.double().abs()) + (
        0 if bias is None else bias.double().abs()
    )
    assert ((out.double() - expected).abs() <= magnitude * 2**-8 + 1e-6).all()
    # float32 out: the same sums before that rounding (float32 summation order alone)
    out32 = packed.matmul(x, bias, torch.float32)
    assert out32.shape == (rows, n) and out32.dtype == torch.float32
    assert torch.equal(out32.to(torch.bfloat16), out)
    assert ((out32.double() - expected).abs() <= magnitude * 2**-14 + 1e-6).all()


def test_bfloat16_logits_are_the_lm_heads_float32_sums(model_path):
    """An unquantized bfloat16 model's packed LM head hands the sampler its float32 sums: rounded to
    bfloat16, logits near 16 lie 1/16 to 1/8 apart, so near-ties become ties that greedy decoding
    breaks by the lower token id (SmolLM2 answered "L'Étoile, ..." to "What is the capital of
    France?" that way, HF's bfloat16 model "The capital of France is Paris.")."""
    model = ModelRunner(model_path, dtype="bfloat16", max_total_tokens=256).model
    weight = model.lm_head.weight
    hidden = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits = model.compute_logits(hidden)
    exact = hidden.double() @ weight.double().T
    assert logits.shape == exact.shape and logits.dtype == torch.float32
    if isinstance(model.lm_head_packed, OneDNNWeight):  # oneDNN rounds to bfloat16 first
        assert torch.equal(logits, logits.bfloat16().float())
    else:
        magnitude = hidden.double().abs() @ weight.double().abs().T
        assert ((logits.double() - exact).abs() <= magnitude * 2**-14).all()
        assert not torch.equal(logits, logits.bfloat16().float())
