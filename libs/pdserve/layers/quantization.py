"""W8A8 int8 linear layers for CPUs: ``--quantization w8a8_int8`` (the name SGLang gives the scheme).

Weights are quantized once after loading, symmetric int8 per output channel (``s_w[n] =
max|W[n, :]| / 127``; ``/ 63`` on CPUs without VNNI, where oneDNN's int8 GEMM would saturate: see
``int8_weight_max``); activations are quantized on the fly, symmetric int8 per token (``s_x[m] =
max|x[m, :]| / 127``), the per-token x per-channel scaling of LLM.int8() (Dettmers et al. 2022) and
SmoothQuant's W8A8 (Xiao et al. 2023) without outlier handling. Then

    y[m, n] = (sum_k q_x[m, k] q_w[n, k]) * s_w[n] * s_x[m] (+ b[n])

With bfloat16 activations on a CPU that runs our matmul kernel (``pdserve.layers.cpu_gemm``: AVX-512
VNNI ``vpdpbusd`` on uint8 activations = int8 + 128 and int8 weight panels, the offset undone by
128 x the weight's column sums, scales and bias applied in its epilogue, SiLU-and-mul fused into
gate/up, the next weight panel prefetched while it computes) a layer is the quantization of its
activations plus one kernel call. Otherwise (float32 activations, other CPUs) the GEMM is oneDNN's
int8 inner product (``torch.ops.onednn.qlinear_pointwise``, VNNI on x86) on a weight packed once
at load (``qlinear_prepack``), with the activations stored offset by 128 as uint8 (zero point 128)
and an activation scale of 1, so it returns ``sum * s_w[n]`` in float32; the per-token
quantization before it and the ``* s_x[m] (+ b)`` epilogue after it are fused C ops
(``cpu_fused_ops``). Activations, KV cache and the LM head keep the model dtype.

Outputs are close to, not equal to, the unquantized model's: greedy continuations drift apart after
a while, as with any quantization. The exactness tests run unquantized; ``tests/engine`` measures
how close this scheme stays.
"""

from __future__ import annotations

import torch

from pdserve.layers.cpu_fused_ops import load_fused_ops
from pdserve.layers.cpu_gemm import load_cpu_gemm
from pdserve.layers.native import cpu_has


def int8_weight_max() -> int:
    """The largest weight magnitude of the int8 quantization on this CPU: 127 where it has VNNI
    (AVX-512 VNNI or AVX-VNNI: ``vpdpbusd`` sums uint8 x int8 products in int32), else 63. Without
    VNNI oneDNN's int8 GEMM multiplies with ``vpmaddubsw``, whose pairs of uint8 x int8 products sum
    in saturating int16 (up to 2 x 255 x 127 = 64,770 > 32,767, silently wrong results); with 7-bit
    weights a pair stays within 2 x 255 x 63 = 32,130, so the GEMM is exact (the weight-side form
    of fbgemm's ``reduce_range``)."""
    return 127 if cpu_has("avx512_vnni", "avx_vnni") else 63


class W8A8Int8LinearMethod:
    """How a ``Linear`` computes under ``w8a8_int8`` (vLLM's ``LinearMethodBase`` shape: the layer keeps
    its module, the method owns the weight transform and the matmul).

    Raises:
        RuntimeError: at ``process_weights_after_loading`` when not on CPU or the fused C ops did not
            build (the int8 path has no fallback worth running).
    """

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Replace ``layer.weight`` ``[N, K]`` by its int8 quantization: ``layer.packed`` (our kernel's
        int8 ``PanelWeight`` with its scales) for bfloat16 layers where that kernel runs, else
        ``layer.weight_packed`` (oneDNN's packed int8 ``[N, K]``), ``layer.weight_scale`` float32
        ``[N]`` and ``layer.weight_zero_point`` int64 zeros ``[N]``; the float weight is dropped."""
        weight = layer.weight.data
        if (
            weight.device.type != "cpu"
            or load_fused_ops() is None
            or not torch.backends.mkldnn.is_available()
        ):
            raise RuntimeError("w8a8_int8 needs the CPU fused ops (a C compiler), oneDNN and a CPU device")
        w = weight.float()
        qmax = int8_weight_max()
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / qmax
        weight_q = torch.round(w / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8)
        gemm = load_cpu_gemm()
        if weight.dtype == torch.bfloat16 and gemm is not None and gemm.supports(weight_q, int8=True):
            layer.packed = gemm.pack_int8(weight_q, scale)
        else:
            layer.weight_packed = torch.ops.onednn.qlinear_prepack(weight_q, None)
            layer.weight_scale = scale
            layer.weight_zero_point = torch.zeros(scale.shape, dtype=torch.int64)
        layer.weight = None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., K]`` (float32 or bfloat16) → ``[..., N]`` in x's dtype."""
        if layer.packed is not None:
            return layer.packed.matmul(x, layer.bias)
        ops = load_fused_ops()
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        q, x_scale = ops.quantize_rows(rows)
        acc = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, 128,  # uint8 activations, scale 1 (the per-token scales come after), zero point 128
            layer.weight_packed, layer.weight_scale, layer.weight_zero_point,
            None, 1.0, 0, torch.float32,  # no bias (added after the scales); float32 out, unscaled
            "none", [None], "",  # no fused post-op
        )  # fmt: skip
        out = ops.dequantize_rows(acc, x_scale, layer.bias, x.dtype)
        return out.view(*shape[:-1], -1)


def get_linear_method(quantization: str | None) -> W8A8Int8LinearMethod | None:
    """The linear method of ``--quantization`` (None: unquantized).

    Raises:
        ValueError: an unknown method name.
    """
    if quantization in (None, "", "none"):
        return None
    if quantization == "w8a8_int8":
        return W8A8Int8LinearMethod()
    raise ValueError(f"unknown quantization {quantization!r}; choose none or w8a8_int8")
