"""The CPU matmuls of ``cpu_matmul`` (every weight format, every kernel variant this CPU runs) against
float64 matmuls of the values the formats store, and the quantizers against what they promise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdserve.layers.cpu_fused_ops import load_fused_ops
from pdserve.layers.cpu_gemm import load_cpu_gemm
from pdserve.layers.cpu_matmul import (
    FORMATS,
    NIBBLE_PLANES,
    MatmulWeight,
    dequantize_int4,
    load_cpu_matmul,
    quantize_int4,
    quantize_int8,
    quantize_int8_grouped,
)
from pdserve.layers.linear import prepack_weight
from pdserve.layers.native import runnable_variants

ROWS = [1, 5, 6, 7, 13, 48, 100]  # one row, partial / full / one-past register tiles, row blocks


@pytest.fixture
def matmul(kernel_variant):
    matmul = load_cpu_matmul()
    assert matmul is not None
    return matmul


def stored_weight(weight: torch.Tensor, format: str) -> torch.Tensor:
    """The float64 weight that ``format`` stores for ``weight``, computed here from the quantizers."""
    n, k = weight.shape
    if format == "float32":
        return weight.double()
    if format == "bf16":
        return weight.bfloat16().double()
    if format in ("int8", "w8a8"):
        q, scale = quantize_int8(weight)
        return q.double() * scale.double()[:, None]
    if format in ("int8_g32", "w8a8_g32"):
        q, scale = quantize_int8_grouped(weight)
        return (q.double().reshape(n, -1, 32) * scale.double()[..., None]).reshape(n, k)
    return dequantize_int4(*quantize_int4(weight)).double()


def reference(x, weight, bias, format):
    """float64 ``x W^T + b`` of the stored weight; w8a8 (w4a8, w8a8_g32): of the activations quantized
    per row (per group of 32 inputs) as the fused op quantizes a row (the kernel's own quantization,
    shared C code)."""
    xd = x.double()
    if format in ("w8a8", "w4a8", "w8a8_g32"):
        groups = x if format == "w8a8" else x.reshape(-1, 32)
        stored, scale = load_fused_ops().quantize_rows(groups)
        xd = ((stored.double() - 128) * scale.double()[:, None]).reshape(x.shape)
    return F.linear(xd, stored_weight(weight, format), None if bias is None else bias.double())


def assert_close(actual, expected, x_dtype):
    # float32: another summation order; bfloat16 activations: the output's own rounding (2^-8)
    assert actual.dtype == x_dtype
    rtol, atol = (2e-5, 2e-5) if x_dtype == torch.float32 else (2**-8, 1e-3)
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("format", [*FORMATS, "w8a8", *NIBBLE_PLANES])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_matmul_matches_float64_of_the_stored_weight(matmul, format, x_dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    n, k = 96, 160
    weight = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen) if rows % 2 else None
    x = torch.randn(rows, k, generator=gen).to(x_dtype)
    if rows > 1:
        x[0] = 0  # a zero row (w8a8: scale 0) gives the bias alone
    packed = matmul.pack(weight, format)
    assert_close(packed.matmul(x, bias), reference(x, weight, bias, format), x_dtype)
    # either output dtype from either activation dtype: the same float32 sums, kept or rounded once
    wide, narrow = packed.matmul(x, bias, torch.float32), packed.matmul(x, bias, torch.bfloat16)
    assert torch.equal(wide.to(torch.bfloat16), narrow)
    assert_close(wide, reference(x, weight, bias, format), torch.float32)
    halves = packed.to_halves()  # the [gate; up] layout: same matmul, and SiLU-and-mul fused
    assert_close(halves.matmul(x, bias), reference(x, weight, bias, format), x_dtype)
    gate, up = reference(x, weight, bias, format).chunk(2, dim=-1)
    if x_dtype == torch.bfloat16:  # rounded where HF's bfloat16 modules round: gate and up, silu, product
        gate, up = gate.bfloat16().double(), up.bfloat16().double()
        expected = (F.silu(gate).bfloat16().double() * up).bfloat16().double()
    else:
        expected = F.silu(gate) * up
    assert_close(halves.silu_and_mul(x, bias), expected, x_dtype)


def test_matmul_on_strided_rows_and_batch_dims(matmul):
    weight = torch.randn(48, 64) * 0.1
    fused = torch.randn(2, 3, 100)
    x = fused[..., 10:74]  # rows strided, as q of a fused qkv tensor
    packed = matmul.pack(weight, "int4")
    out = packed.matmul(x)
    assert out.shape == (2, 3, 48)
    assert_close(out, reference(x.reshape(-1, 64), weight, None, "int4").view(2, 3, 48), torch.float32)


def test_int4_stores_q4_1_weights_exactly():
    """A GGUF's Q4_1 block (fp16 scale d and minimum m, w = d q + m with q in 0..15 and both ends
    taken) comes back unchanged: the int4 format is lossless on such a checkpoint."""
    gen = torch.Generator().manual_seed(0)
    n, k = 32, 256
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.08).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15  # llama.cpp's quantizer maps the block's min to 0 and max to 15
    w = (q * d[..., None] + m[..., None]).reshape(n, k)
    restored = dequantize_int4(*quantize_int4(w))
    torch.testing.assert_close(restored, w, rtol=2**-22, atol=0)


def test_int8_groups_store_q8_0_weights_exactly():
    gen = torch.Generator().manual_seed(1)
    n, k = 16, 128
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen)
    q[..., 0] = 127  # the block's largest magnitude maps to +-127
    w = (q * d[..., None]).reshape(n, k)
    q8, scale = quantize_int8_grouped(w)
    torch.testing.assert_close(
        (q8.reshape(n, -1, 32) * scale[..., None]).reshape(n, k), w, rtol=2**-22, atol=0
    )


def test_w8a8_integer_sums_are_exact(matmul):
    """Weights at +-127 and activations at +-127: every pair product sum is exactly representable,
    where oneDNN's AVX2 u8 x s8 instruction saturates its int16 pair sums."""
    k = 512
    weight = torch.full((16, k), 127.0)
    weight[1::2] = -127.0
    x = torch.full((3, k), 1.0)
    out = matmul.pack(weight, "w8a8").matmul(x)
    torch.testing.assert_close(out, (x @ weight.T), rtol=1e-6, atol=0)


def test_bfloat16_linear_packs_here_where_onednn_has_no_bfloat16():
    """AVX2 CPUs: oneDNN has no bfloat16 matmul there, so bfloat16 layers use the bf16 panels."""
    weight = torch.randn(96, 64).bfloat16()
    packed = prepack_weight(weight)
    if load_cpu_gemm() is None and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert isinstance(packed, MatmulWeight) and packed.format == "bf16"
        x = torch.randn(3, 64).bfloat16()
        assert_close(packed.matmul(x), reference(x, weight, None, "bf16"), torch.bfloat16)


OUT_OF_MEMORY = """
import resource, torch
from pdserve.layers.cpu_matmul import load_cpu_matmul
torch.manual_seed(0)
weights = {f: load_cpu_matmul().pack(torch.randn(16, 4096), f) for f in ("float32", "w8a8", "w4a8")}
x = torch.randn(32768, 4096, dtype=torch.bfloat16)  # 256 MiB: widened or quantized, 128-512 MiB of scratch
expected = {f: w.matmul(x) for f, w in weights.items()}  # (also starts OpenMP's threads)
vm_size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
limits = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (vm_size + (96 << 20), limits[1]))  # 96 MiB more address space
for f, w in weights.items():
    try:
        w.matmul(x)
        raise AssertionError(f"{f}: the matmul ran without its scratch")
    except MemoryError as e:
        assert "no memory for its scratch buffers" in str(e), e
    assert torch.equal(w.matmul(x[:4]), expected[f][:4])  # small batches still run
resource.setrlimit(resource.RLIMIT_AS, limits)
assert all(torch.equal(w.matmul(x), expected[f]) for f, w in weights.items())
"""


@pytest.mark.parametrize("variant", runnable_variants())
def test_a_matmul_without_memory_for_its_scratch_raises_and_the_next_one_runs(variant):
    """The kernels' scratch (activations widened to float32 or quantized) comes from malloc; under an
    address-space limit it fails, and the call raises MemoryError instead of writing through NULL."""
    env = {**os.environ, "PDSERVE_CPU_KERNELS": variant}
    code = [sys.executable, "-c", OUT_OF_MEMORY]
    run = subprocess.run(code, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
