"""Matmuls for any x86-64 CPU over weights packed once at load: float activations (float32 or
bfloat16) against float32, bfloat16, int8 or int4 weights, and an exact int8 x int8 (W8A8) matmul.

On CPUs without native bfloat16 (AVX2 + FMA: AMD Zen 2/3, Intel Haswell to Ice Lake clients) a
decode step is bound by reading the weights, and a float32 weight costs four bytes a parameter.
These kernels read weights stored smaller and widen them in registers: bfloat16 (``bf16``), int8
per output column (``int8``: ``w = q * scale[n]``), int8 in groups of 32 inputs (``int8_g32``:
``w = q * scale[g, n]``, llama.cpp's Q8_0) or int4 in groups of 32 with a scale and a minimum
(``int4``: ``w = q * scale[g, n] + min[g, n]``, ``q`` in 0..15: llama.cpp's Q4_1), so a GGUF's
Q4_1 and Q8_0 weights are stored exactly; sums are float32, as ``F.linear`` on the dequantized
weight computes them, in another order. ``w8a8`` quantizes each row of activations to int8 (per
row, symmetric) and sums int8 x int8 products exactly in int32 (AVX2 ``vpmaddwd`` on int16: the
u8 x s8 instruction oneDNN uses without VNNI saturates, which made its int8 GEMM wrong there),
twice the float32 FMA rate on these CPUs. ``w4a8`` stores the weight as ``int4`` does and quantizes
the activations to int8 per group of 32 inputs (llama.cpp's Q4_1 x Q8_1 dot product): the sums of
int4 x int8 products per group are exact integers (VNNI ``vpdpbusd``, or AVX2 ``vpmaddubsw``, which
cannot saturate on 4-bit weights), so a weight costs no float conversion; one stream's decode step
is then bound by reading the weights rather than by widening them. ``w8a8_g32`` (the LM head under
``w4a8``) runs ``int8_g32``'s weights the same way, each as two 4-bit planes of ``q + 128``.

Layout and algorithm: see ``pdserve/c-kernels/matmul.c`` and ``w4a8.c`` (panels of 16 output
columns, a register-blocked micro-kernel, SiLU-and-mul in the epilogue of a ``[gate; up]`` weight
packed in ``halves``; W4A8 on AMX tiles from 16 rows, ``amx.c``). Every format computes a row the
same way whatever the number of rows (batch-invariant). The portable variant runs the same sums in
plain C. ``load_cpu_matmul`` returns None when the kernels are off.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.layers.native import kernel_library, per_variant

PANEL = 16  # output columns per panel
GROUP = 32  # int4: inputs per scale
FORMATS = {"float32": 0, "bf16": 1, "int8": 2, "int4": 3, "int8_g32": 4}  # matmul.c's W_F32 .. W_I8G
GROUPED = ("int4", "int8_g32", "w4a8", "w8a8_g32")  # scales per group of 32 inputs
NIBBLE_PLANES = {"w4a8": 1, "w8a8_g32": 2}  # w4a8.c's matmul_w4a8 formats: 4-bit planes a weight
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _rows_in_panels(w: torch.Tensor, halves: bool) -> torch.Tensor:
    """``w`` ``[N, ...]`` with its rows in panel order: with ``halves``, panel ``j`` holds rows
    ``8j..8j+7`` of each half of ``w`` (gate, then the same up rows), else rows ``16j..16j+15``."""
    if not halves:
        return w
    n = w.shape[0]
    return w.reshape(2, n // PANEL, PANEL // 2, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _nibble_panels(panels: torch.Tensor, planes: int) -> torch.Tensor:
    """``panels`` ``[P, 16, K]`` (uint8 0..15 for one plane, int8 for two) in matmul_w4a8's layout,
    ``[P, K / 32, planes, quarter, column, i]`` bytes: inputs ``8 quarter + i`` in the low nibbles,
    ``8 quarter + 4 + i`` in the high ones; int8 ``q`` as the planes of ``q + 128`` (low, high)."""
    p, _, k = panels.shape
    if planes == 2:
        u = (panels.to(torch.int16) + 128).to(torch.uint8)
        values = torch.stack([u & 15, u >> 4], dim=-1)
    else:
        values = panels.unsqueeze(-1)
    q = values.reshape(p, PANEL, k // GROUP, 4, 2, 4, planes).permute(0, 2, 6, 3, 1, 5, 4)
    return (q[..., 0] | (q[..., 1] << 4)).contiguous()


def _nibble_values(data: torch.Tensor) -> torch.Tensor:
    """``_nibble_panels``' inverse: the ``[P, 16, K]`` values back."""
    p, groups, planes = data.shape[:3]
    nibbles = torch.stack([data & 15, data >> 4], dim=-1)  # [P, G, plane, quarter, column, i, nibble]
    values = nibbles.permute(0, 4, 1, 3, 6, 5, 2).reshape(p, PANEL, groups * GROUP, planes)
    if planes == 1:
        return values[..., 0]
    return (values[..., 0].to(torch.int16) + 16 * values[..., 1].to(torch.int16) - 128).to(torch.int8)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row of ``weight`` ``[N, K]``: (int8 ``q``, float32 ``scale`` ``[N]``),
    ``scale = max|w| / 127``, ``q = round-half-even(w / scale)``."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def _half(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to float16 (as the grouped formats store their scales), kept as float32."""
    return x.half().float()


def quantize_int8_grouped(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 in groups of 32 inputs (llama.cpp's Q8_0): (int8 ``q`` ``[N, K]``, ``scale``
    ``[N, K / 32]``), ``scale = max|w| / 127`` over the group rounded to float16 (held in float32).
    ``K`` a multiple of 32."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP, GROUP)
    scale = _half(w.abs().amax(dim=2) / 127)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / safe[..., None]).clamp_(-127, 127).to(torch.int8).reshape(n, k), scale


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of 32 inputs (llama.cpp's Q4_1): (uint8 ``q`` ``[N, K]`` in 0..15,
    ``scale`` and ``mins`` ``[N, K / 32]``, float16 values held in float32) with ``w ~ q * scale +
    min``, ``min`` the group's smallest weight and ``scale = (max - min) / 15``, both rounded to
    float16 as GGUF stores them (so a Q4_1 block's own values come back). ``K`` a multiple of 32."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP, GROUP)
    mins, maxs = _half(w.amin(dim=2)), w.amax(dim=2)
    scale = _half((maxs - mins) / 15)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((w - mins[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, mins


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[N, K]`` that ``quantize_int4``'s outputs stand for."""
    n, k = q.shape
    w = torch.addcmul(mins[..., None], q.reshape(n, k // GROUP, GROUP).float(), scale[..., None])
    return w.reshape(n, k)


class MatmulWeight:
    """A weight ``W`` ``[N, K]`` packed for ``CpuMatmul`` in one of ``FORMATS``, ``w8a8`` or
    ``NIBBLE_PLANES``, from its stored values ``rows`` ``[N, K]`` (float32 / bfloat16 weights, int8 or
    int4 ``q``) and scales.

    Attributes:
        format: ``float32``, ``bf16``, ``int8``, ``int4``, ``int8_g32`` (float activations), ``w8a8``,
            or ``w4a8`` / ``w8a8_g32`` (``int4``'s / ``int8_g32``'s weights, activations quantized
            to int8 per group of 32).
        halves: panels pair gate and up rows (``silu_and_mul`` works); ``matmul`` is the same either way.
        data: the panels; scale: int8 / w8a8 float32 ``[N]``, grouped formats float16
            ``[N / 16, K / 32, 16]``; mins: int4's, w4a8's and w8a8_g32's, the same.
    """

    def __init__(
        self, kernel: CpuMatmul, format: str, rows: torch.Tensor, scale=None, mins=None, halves=False
    ):
        n, k = rows.shape
        self._kernel, self.format, self.halves = kernel, format, halves
        self.out_features, self.in_features = n, k
        panels = _rows_in_panels(rows, halves).reshape(n // PANEL, PANEL, k)
        self.scale, self.mins = scale, mins
        if format == "w8a8":
            self.data = panels.reshape(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        elif format == "int4":
            q = panels.transpose(1, 2)
            self.data = (q[..., : PANEL // 2] | (q[..., PANEL // 2 :] << 4)).contiguous()
        elif format in NIBBLE_PLANES:
            self.data = _nibble_panels(panels, NIBBLE_PLANES[format])
        else:
            self.data = panels.transpose(1, 2).contiguous()
        if format in GROUPED:  # float16 [N / 16, K / 32, 16]
            self.scale, self.mins = (
                None
                if t is None
                else _rows_in_panels(t, halves)
                .reshape(n // PANEL, PANEL, -1)
                .transpose(1, 2)
                .half()
                .contiguous()
                for t in (scale, mins)
            )

    def _rows(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The stored values and scales back in row order (``halves`` False only)."""
        n, k = self.out_features, self.in_features
        if self.format == "w8a8":
            return self.data.permute(0, 2, 1, 3).reshape(n, k), self.scale, None
        if self.format in NIBBLE_PLANES:
            rows = _nibble_values(self.data).reshape(n, k)
        else:
            data = torch.cat([self.data & 15, self.data >> 4], dim=2) if self.format == "int4" else self.data
            rows = data.transpose(1, 2).reshape(n, k)
        scale, mins = self.scale, self.mins
        if self.format in GROUPED:
            scale, mins = (
                None if t is None else t.transpose(1, 2).reshape(n, k // GROUP).float() for t in (scale, mins)
            )
        return rows, scale, mins

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads from the weight (panels and scales)."""
        return sum(t.nbytes for t in (self.data, self.scale, self.mins) if t is not None)

    def to_halves(self) -> MatmulWeight:
        """The same weight packed in ``halves`` (for ``silu_and_mul``)."""
        if self.halves:
            return self
        rows, scale, mins = self._rows()
        return MatmulWeight(self._kernel, self.format, rows, scale, mins, halves=True)

    def matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``x W^T (+ bias)`` for float32 or bfloat16 ``x`` ``[..., K]``: a new ``[..., N]`` of
        ``out_dtype`` (float32 or bfloat16; default x's dtype).

        Raises:
            MemoryError: the kernel's scratch buffers (the activations widened or quantized) could not
                be allocated.
        """
        return self._run(x, bias, silu=False, out_dtype=out_dtype or x.dtype)

    def silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``silu(gate) * up`` of ``[gate | up] = x W^T (+ bias)``: ``[..., N / 2]`` (``halves`` only).

        Raises:
            ValueError: the weight was not packed with ``halves``.
            MemoryError: as ``matmul``.
        """
        if not self.halves:
            raise ValueError("silu_and_mul needs a weight packed with halves=True")
        return self._run(x, bias, silu=True, out_dtype=x.dtype)

    def _run(
        self, x: torch.Tensor, bias: torch.Tensor | None, silu: bool, out_dtype: torch.dtype
    ) -> torch.Tensor:
        for name, dtype in (("activations", x.dtype), ("output", out_dtype)):
            if dtype not in (torch.float32, torch.bfloat16):
                raise TypeError(f"the CPU matmul takes float32 or bfloat16 {name}, got {dtype}")
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        n, k, m = self.out_features, self.in_features, rows.shape[0]
        width = n // 2 if silu else n
        out = torch.empty(m, width, dtype=out_dtype)
        if m:
            if bias is not None and bias.dtype != torch.float32:
                bias = bias.float()
            x_bf16 = x.dtype == torch.bfloat16
            out_bf16 = out_dtype == torch.bfloat16
            tail = (out.data_ptr(), width, out_bf16, m, n, k, self.halves, silu, torch.get_num_threads())
            bias_ptr = None if bias is None else bias.data_ptr()
            if self.format == "w8a8":
                status = self._kernel.w8a8_fn(
                    rows.data_ptr(), rows.stride(0), x_bf16, self.data.data_ptr(),
                    self.scale.data_ptr(), bias_ptr, *tail,
                )  # fmt: skip
            elif self.format in NIBBLE_PLANES:
                status = self._kernel.w4a8_fn(
                    rows.data_ptr(), rows.stride(0), x_bf16, self.data.data_ptr(), NIBBLE_PLANES[self.format],
                    self.scale.data_ptr(), self.mins.data_ptr(), bias_ptr, *tail,
                )  # fmt: skip
            else:
                status = self._kernel.float_fn(
                    rows.data_ptr(), rows.stride(0), x_bf16, FORMATS[self.format], self.data.data_ptr(),
                    None if self.scale is None else self.scale.data_ptr(),
                    None if self.mins is None else self.mins.data_ptr(), bias_ptr, *tail,
                )  # fmt: skip
            if status:
                raise MemoryError(f"CPU matmul ({self.format}, {m} x {k}): no memory for its scratch buffers")
        return out.view(*shape[:-1], width)


class CpuMatmul:
    """The kernels of one library variant; ``pack`` a weight for them."""

    def __init__(self, lib: ctypes.CDLL):
        self.float_fn, self.w8a8_fn, self.w4a8_fn = lib.matmul_float, lib.matmul_w8a8, lib.matmul_w4a8
        tail = [_P, _I, _C, _C, _C, _C, _C, _C, _C]  # out, ldc, out_bf16, M, N, K, halves, silu, threads
        self.float_fn.restype, self.float_fn.argtypes = _C, [_P, _I, _C, _C, _P, _P, _P, _P, *tail]
        self.w8a8_fn.restype, self.w8a8_fn.argtypes = _C, [_P, _I, _C, _P, _P, _P, *tail]
        self.w4a8_fn.restype, self.w4a8_fn.argtypes = _C, [_P, _I, _C, _P, _C, _P, _P, _P, *tail]

    @staticmethod
    def supports(weight: torch.Tensor, format: str) -> bool:
        """Whether ``weight`` ``[N, K]`` packs in ``format``: on CPU, ``N % 16 == 0``, and for int4 and
        int8_g32, w4a8 and w8a8_g32 ``K % 32 == 0``, for w8a8 ``K`` even."""
        n, k = weight.shape
        k_multiple = 2 if format == "w8a8" else GROUP if format in GROUPED else 1
        return weight.device.type == "cpu" and n % PANEL == 0 and k % k_multiple == 0

    def pack(self, weight: torch.Tensor, format: str, halves: bool = False) -> MatmulWeight:
        """Pack (quantize) ``weight`` ``[N, K]`` (any float dtype, ``supports(weight, format)``).

        Raises:
            ValueError: an unknown format.
        """
        weight = weight.detach()
        if format == "float32":
            return MatmulWeight(self, format, weight.float(), halves=halves)
        if format == "bf16":
            return MatmulWeight(self, format, weight.to(torch.bfloat16), halves=halves)
        if format in ("int8", "w8a8"):
            q, scale = quantize_int8(weight)
            return MatmulWeight(self, format, q, scale.contiguous(), halves=halves)
        if format == "int8_g32":
            q, scale = quantize_int8_grouped(weight)
            return MatmulWeight(self, format, q, scale, halves=halves)
        if format == "w8a8_g32":  # w = (q + 128) * scale - 128 * scale
            q, scale = quantize_int8_grouped(weight)
            return MatmulWeight(self, format, q, scale, -128 * scale, halves=halves)
        if format in ("int4", "w4a8"):
            q, scale, mins = quantize_int4(weight)
            return MatmulWeight(self, format, q, scale, mins, halves=halves)
        known = [*FORMATS, "w8a8", *NIBBLE_PLANES]
        raise ValueError(f"unknown weight format {format!r}; choose one of {known}")


@per_variant
def load_cpu_matmul(variant: str) -> CpuMatmul:
    """The kernels of the selected variant (``pdserve.layers.native``); None when the kernels are off."""
    return CpuMatmul(kernel_library(variant))
