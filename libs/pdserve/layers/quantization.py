"""Quantized linear layers for CPUs (``--quantization``).

``w8a8_int8`` (the name SGLang gives the scheme): weights quantized once after loading, symmetric
int8 per output channel (``s_w[n] = max|W[n, :]| / 127``), activations quantized on the fly,
symmetric int8 per token (``s_x[m] = max|x[m, :]| / 127``), the per-token x per-channel scaling of
LLM.int8() (Dettmers et al. 2022) and SmoothQuant's W8A8 (Xiao et al. 2023) without outlier
handling; ``y[m, n] = (sum_k q_x[m, k] q_w[n, k]) * s_w[n] * s_x[m] (+ b[n])``, the integer sums
exact on every CPU (``pdserve.layers.cpu_matmul``'s ``w8a8`` format).

``int8_weight_only`` / ``int4_weight_only`` (torchao's names for the schemes): only the weights are
quantized, int8 per output channel or int4 in groups of 32 inputs with a scale and a minimum
(llama.cpp's Q4_1); activations stay float and the kernel widens the weights in registers
(``pdserve.layers.cpu_matmul``). For CPUs without native bfloat16, where a float32 weight costs
four bytes a parameter per decode step. ``int4_or_int8`` takes int4 where it is lossless (a GGUF's
Q4_1 weights), else int8.

``w4a8``: int4 weights as ``int4_weight_only`` stores them, activations quantized to int8 per group
of 32 inputs on the fly, products summed exactly in integers per group: llama.cpp's Q4_1 x Q8_1
dot product, the arithmetic llama.cpp itself runs on the same GGUF. No weight is widened to float,
so a decode step is bound by reading its weights.

In every scheme the LM head is stored as int8 in groups of 32 inputs (llama.cpp's Q8_0), with
float activations (``w4a8`` on AVX-512: int8 per group, as its layers); KV cache and activations
keep the model dtype. ``auto`` picks, per CPU, the fastest scheme that stays close to the
unquantized model (``resolve_quantization``).

Outputs are close to, not equal to, the unquantized model's: greedy continuations drift apart after
a while, as with any quantization. The exactness tests run unquantized; ``tests/engine`` measures
how close each scheme stays (top-1 agreement and perplexity against HF fp32).
"""

from __future__ import annotations

import torch

from pdserve.layers.cpu_matmul import (
    MatmulWeight,
    dequantize_int4,
    load_cpu_matmul,
    quantize_int4,
)
from pdserve.layers.native import selected_variant

METHODS = ("w8a8_int8", "int8_weight_only", "int4_weight_only", "int4_or_int8", "w4a8")


class PackedLinearMethod:
    """How a ``Linear`` computes when quantized (vLLM's ``LinearMethodBase`` shape: the layer keeps its
    module, the method owns the weight transform and the matmul): its weight packed once in
    ``cpu_matmul`` format ``format``.

    Raises:
        RuntimeError: at ``process_weights_after_loading`` when not on CPU or the CPU kernels are off.
    """

    format = ""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Replace ``layer.weight`` ``[N, K]`` by ``layer.packed`` (the float weight is dropped)."""
        layer.packed = self.pack(layer.weight.data)
        layer.weight = None

    def pack(self, weight: torch.Tensor) -> MatmulWeight:
        """``weight`` ``[N, K]`` quantized and packed (``packed.matmul(x, bias)``).

        Raises:
            RuntimeError: not on CPU, the CPU kernels are off, or the shape does not fit the kernel.
        """
        matmul = load_cpu_matmul()
        if weight.device.type != "cpu" or matmul is None or not matmul.supports(weight, self.format):
            raise RuntimeError(
                f"{type(self).__name__} needs a CPU device, the CPU kernels (pdserve.layers.native) and "
                f"weights whose shape the kernel takes (got {tuple(weight.shape)})"
            )
        return matmul.pack(weight, self.format)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., K]`` (float32 or bfloat16) → ``[..., N]`` in x's dtype."""
        return layer.packed.matmul(x, layer.bias)

    def pack_lm_head(self, weight: torch.Tensor) -> MatmulWeight:
        """The LM head ``[V, H]``: int8 in groups of 32 inputs (Q8_0: exact for a GGUF's Q8_0 head),
        float activations; per output channel where ``H`` is not a multiple of 32."""
        matmul = load_cpu_matmul()
        if matmul is not None and matmul.supports(weight, "int8_g32"):
            return matmul.pack(weight, "int8_g32")
        return Int8WeightOnlyLinearMethod().pack(weight)


class W8A8Int8LinearMethod(PackedLinearMethod):
    """``w8a8_int8``: int8 weights per output channel and per-token int8 activations, integer sums
    exact (``cpu_matmul``'s ``w8a8`` format on every CPU, which the fused decoder and the grouped
    experts run)."""

    format = "w8a8"


class Int8WeightOnlyLinearMethod(PackedLinearMethod):
    """``int8_weight_only``: int8 weights per output channel, float activations."""

    format = "int8"


class Int4WeightOnlyLinearMethod(PackedLinearMethod):
    """``int4_weight_only``: int4 weights in groups of 32 inputs (scale and minimum), float activations."""

    format = "int4"


class W4A8LinearMethod(PackedLinearMethod):
    """``w4a8``: int4 weights in groups of 32 inputs as ``int4_weight_only`` stores them, activations
    quantized to int8 per group of 32 on the fly, the products summed exactly in integers per group
    (llama.cpp's Q4_1 x Q8_1 dot product; ``cpu_matmul``'s ``w4a8`` format). The LM head is int8 in
    groups of 32 as in every scheme; with the AVX-512 kernel variants its activations are quantized
    the same way (``w8a8_g32``: Q8_0 x Q8_1; SmolLM2's head on a Zen 5, batch 1 / 16 / 64: 0.54 /
    5.6 / 19.8 ms against 1.11 / 10.8 / 26.1 widened to float). The AVX2 variant keeps float
    activations there: its two 4-bit planes through 256-bit ``vpmaddubsw`` cost more than widening
    int8 to float from batch 16 on (9.0 vs 7.4 ms)."""

    format = "w4a8"

    def pack_lm_head(self, weight: torch.Tensor) -> MatmulWeight:
        matmul = load_cpu_matmul()
        avx512 = selected_variant() in ("amx", "avx512bf16", "avx512")
        if avx512 and matmul is not None and matmul.supports(weight, "w8a8_g32"):
            return matmul.pack(weight, "w8a8_g32")
        return super().pack_lm_head(weight)


class LosslessInt4OrInt8LinearMethod(PackedLinearMethod):
    """``int4_or_int8``: each weight as int4 where that stores it exactly
    (a GGUF's Q4_1 weights: every group of 32 is ``q * scale + min``, ``q`` in 0..15), else int8
    per output channel (``int8_weight_only``). "Exactly" up to the float16 rounding of the converted
    checkpoint (``model_source.gguf_dtype``: <= 2^-11 relative per value): int4 is taken where it
    reproduces every weight within ``LOSSLESS_TOLERANCE`` of the tensor's largest magnitude
    (SmolLM2's Q4_1 projections: <= 4.2e-4; its Q8_0 LM head: 4.6e-2)."""

    LOSSLESS_TOLERANCE = 2**-10

    def pack(self, weight: torch.Tensor) -> MatmulWeight:
        matmul = load_cpu_matmul()
        if matmul is not None and matmul.supports(weight, "int4"):
            w = weight.float()
            error = (dequantize_int4(*quantize_int4(w)) - w).abs().max()
            if error <= self.LOSSLESS_TOLERANCE * w.abs().max():
                return Int4WeightOnlyLinearMethod().pack(weight)
        return Int8WeightOnlyLinearMethod().pack(weight)


def resolve_quantization(
    quantization: str | None,
    device: torch.device,
    dtype: torch.dtype,
    tp_size: int = 1,
    explicit_dtype: bool = False,
) -> str | None:
    """``--quantization`` with ``auto`` resolved: ``w4a8`` (``W4A8LinearMethod``) on a CPU whose kernels
    run, for the ``auto`` dtype (float32 or bfloat16 by the CPU), else none. On every CPU class a
    decode step of a small batch reads its weights from memory, and ``w4a8`` reads 0.625 bytes a
    parameter where bfloat16 reads 2 (SmolLM2 on a Sapphire Rapids: ~3x the single-stream tokens/s,
    see docs/cpu.md); from 16 rows on, AMX tiles (where the CPU has them) give the same sums as the
    vector kernel, so results do not depend on the batch. A dtype named on purpose (``--dtype
    float32``: token for token Hugging Face's; ``bfloat16``) runs unquantized. Other names are
    returned as they are (``none`` → None). Under tensor parallelism (``tp_size`` > 1) the methods
    are not supported: ``auto`` is none.

    Raises:
        ValueError: a quantization method named with ``tp_size`` > 1.
    """
    if quantization in (None, "", "none"):
        return None
    if tp_size > 1:
        if quantization == "auto":
            return None
        raise ValueError(
            f"--quantization {quantization} is not supported with --tp-size {tp_size} "
            "(tensor-parallel layers run unquantized: use --quantization none or auto)"
        )
    if quantization != "auto":
        return quantization
    kernels = device.type == "cpu" and load_cpu_matmul() is not None
    if kernels and not explicit_dtype and dtype in (torch.float32, torch.bfloat16):
        return "w4a8"
    return None


def get_linear_method(quantization: str | None) -> PackedLinearMethod | None:
    """The linear method of a resolved ``--quantization`` (None: unquantized).

    Raises:
        ValueError: an unknown method name.
    """
    if quantization in (None, "", "none"):
        return None
    methods: dict[str, type[PackedLinearMethod]] = {
        "w8a8_int8": W8A8Int8LinearMethod,
        "int8_weight_only": Int8WeightOnlyLinearMethod,
        "int4_weight_only": Int4WeightOnlyLinearMethod,
        "int4_or_int8": LosslessInt4OrInt8LinearMethod,
        "w4a8": W4A8LinearMethod,
    }
    if quantization not in methods:
        raise ValueError(f"unknown quantization {quantization!r}; choose none, auto or one of {METHODS}")
    return methods[quantization]()
