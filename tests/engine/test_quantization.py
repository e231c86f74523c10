"""``--quantization``: the int8 linear against a float64 computation of the same scheme, ``auto``'s
choice, and each quantized SmolLM2 against Hugging Face's unquantized model on real text
(teacher-forced): top-1 agreement and perplexity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.model_runner import ModelRunner
from pdserve.layers.cpu_fused_ops import load_fused_ops
from pdserve.layers.cpu_matmul import MatmulWeight
from pdserve.layers.linear import Linear
from pdserve.layers.native import selected_variant
from pdserve.layers.quantization import W8A8Int8LinearMethod, get_linear_method, resolve_quantization
from tests.engine.driver import Driver


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_is_symmetric_per_row_int8(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 576, generator=gen) * torch.rand(64, 1, generator=gen) * 8).to(dtype)
    x[3] = 0
    stored, scale = load_fused_ops().quantize_rows(x)
    assert stored.dtype == torch.uint8
    q = stored.int() - 128
    amax = x.float().abs().amax(dim=1)
    torch.testing.assert_close(scale, amax / 127, rtol=2**-22, atol=0)  # within an ulp or two
    assert scale[3] == 0 and not q[3].any()
    assert q.abs().amax(dim=1)[amax > 0].eq(127).all()  # each row's largest value maps to +-127
    exact = x.float()[amax > 0] / (amax[amax > 0, None] / 127)
    assert (q[amax > 0].float() - exact).abs().max() <= 0.5 + 1e-4  # rounded to nearest


def quantized_reference(q_x, scale_x, weight, bias) -> torch.Tensor:
    """The int8 GEMM and epilogue in float64, from the layer's own quantized activations (uint8, offset
    by 128), with the weight quantized independently here (symmetric per output channel to the CPU's
    largest magnitude, round half to even)."""
    w = weight.float()
    qmax = 127
    scale_w = w.abs().amax(dim=1) / qmax
    q_w = torch.round(w / scale_w[:, None]).clamp(-qmax, qmax)
    out = ((q_x.double() - 128) @ q_w.double().T) * scale_x.double()[:, None] * scale_w.double()[None, :]
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_float64_reference(kernel_variant, dtype, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(576, 960, bias=bias).to(dtype)
    layer.weight.data = (torch.randn(960, 576, generator=gen) * 0.05).to(dtype)
    if bias:
        layer.bias.data = torch.randn(960, generator=gen).to(dtype)
    weight, b = layer.weight.data.clone(), None if layer.bias is None else layer.bias.data.clone()
    layer.quant_method = W8A8Int8LinearMethod()
    layer.process_weights_after_loading()
    assert layer.weight is None
    assert isinstance(layer.packed, MatmulWeight) and layer.packed.format == "w8a8"  # on every CPU

    x = torch.randn(rows, 576, generator=gen).to(dtype)
    if rows > 1:
        x[0] = 0  # an all-zero row (scale 0) gives the bias alone
    out = layer(x)
    assert out.shape == (rows, 960) and out.dtype == dtype
    expected = quantized_reference(*load_fused_ops().quantize_rows(x), weight, b)
    # float32: summation order only; bfloat16: the output's own rounding (2^-8 relative)
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-8, 1e-5)
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol)
    # and the scheme stays within ~1% of the unquantized matmul on Gaussian data
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert (out.double() - exact).norm() / exact.norm() < 0.02


def test_unknown_method_is_refused():
    assert get_linear_method("none") is None
    with pytest.raises(ValueError, match="unknown quantization 'fp4'"):
        get_linear_method("fp4")


def test_auto_quantizes_the_auto_dtype_on_every_cpu_and_leaves_a_named_dtype_alone():
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):  # the auto dtype: float32 or bfloat16 by the CPU
        assert resolve_quantization("auto", cpu, dtype) == "w4a8"
        assert resolve_quantization("auto", cpu, dtype, explicit_dtype=True) is None  # HF-exact float32
        assert resolve_quantization("auto", cpu, dtype, tp_size=2) is None
    assert resolve_quantization("auto", torch.device("meta"), torch.bfloat16) is None  # not a CPU
    assert resolve_quantization("none", cpu, torch.float32) is None
    assert resolve_quantization("w8a8_int8", cpu, torch.float32, explicit_dtype=True) == "w8a8_int8"


# (dtype, method, smallest top-1 agreement with HF fp32, largest perplexity ratio): int4 stores the
# GGUF's Q4_1 weights and its Q8_0 LM head exactly, so only summation order differs from HF's
ACCURACY = [
    ("bfloat16", "w8a8_int8", 0.85, 1.08),
    ("float32", "w8a8_int8", 0.85, 1.08),
    ("float32", "int8_weight_only", 0.95, 1.03),
    ("float32", "int4_weight_only", 0.995, 1.001),
    ("float32", "int4_or_int8", 0.995, 1.001),  # every SmolLM2 weight is int4 then
    ("float32", "w4a8", 0.95, 1.01),  # auto's; measured 0.975 and 11.66 (AVX-512), 0.967 and 11.70 (avx2)
    ("bfloat16", "w4a8", 0.94, 1.01),  # 0.959 and 11.62 (AVX-512), 0.975 and 11.65 (avx2)
]


@pytest.mark.parametrize(("dtype", "method", "min_agreement", "max_ppl_ratio"), ACCURACY)
def test_quantized_smollm2_stays_close_to_hf(
    model_path, hf_model, tokenizer, long_text, dtype, method, min_agreement, max_ppl_ratio
):
    """Teacher-forced over ~500 tokens of real prose: the quantized model's top-1 next token agrees
    with HF's fp32 model at most positions and its perplexity is within a few percent, while every
    linear layer (and the LM head) runs quantized."""
    runner = ModelRunner(model_path, dtype=dtype, max_total_tokens=4096, quantization=method)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.quant_method is not None for m in linears)
    assert isinstance(runner.model.lm_head_packed, MatmulWeight)
    if method == "int4_or_int8":
        assert {m.packed.format for m in linears} == {"int4"}
    if method == "w4a8":  # integer dots everywhere, the LM head's too where the kernels are AVX-512
        assert {m.packed.format for m in linears} == {"w4a8"}
        avx512 = selected_variant() in ("amx", "avx512bf16", "avx512")
        assert runner.model.lm_head_packed.format == ("w8a8_g32" if avx512 else "int8_g32")
    ids = tokenizer(long_text)["input_ids"][:512]

    driver = Driver(runner)
    seq = driver.add(ids)
    forward_batch = driver.prepare([(seq, None)])
    with torch.inference_mode():  # the forward of the runner, keeping every position's logits
        runner.attn_backend.init_forward_metadata(forward_batch)
        hidden = runner.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
        ours = runner.model.compute_logits(hidden).float()
    driver.release(seq)
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].float()

    agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    targets = torch.tensor(ids[1:])
    ppl_ours = F.cross_entropy(ours[:-1], targets).exp().item()
    ppl_hf = F.cross_entropy(reference[:-1], targets).exp().item()
    print(f"{dtype} {method}: top-1 agreement {agreement:.3f}, perplexity {ppl_ours:.2f} vs HF {ppl_hf:.2f}")
    assert agreement > min_agreement
    assert ppl_ours < ppl_hf * max_ppl_ratio
