"""Matmuls for CPUs with AVX512-BF16 and AVX512-VNNI: a small OpenMP C kernel over bfloat16 weights
packed once at load (``vdpbf16ps``).

At decode batch sizes a linear layer reads its whole weight from memory for a few dozen rows of
activations, and the next layer's weight is never in cache (SmolLM2-135M: 270 MB of weights per
step against 32 MB of L3). oneDNN's bfloat16 matmul computes near the cores' peak once its weight
is cached, but does not overlap fetching a cold weight with arithmetic: a batch-64 decoder layer's
four matmuls took 20-35% longer with their weights cold than warm. This kernel asks for the
next weight panel while it computes the current one, so the fetch hides behind arithmetic (a
batch-64 step's decoder matmuls: ~34 ms here against ~43-48 ms through oneDNN's packed weights,
cold, on a 2-core AMD EPYC with AVX512-BF16; ``benchmarks/engine.py`` shows the whole step). Its
epilogue also does what would otherwise be a separate pass: SiLU-and-mul after gate/up.

Layout: a weight ``W`` ``[N, K]`` is packed into panels of 32 output columns, ``[N / 32, K / 2,
32, 2]``: for each pair of input features, the 32 columns' weights side by side, which is the
operand order of ``vdpbf16ps``: a 512-bit register of 16 columns x 2 bfloat16 features. A panel is
one contiguous run of ``K * 64`` bytes.

Algorithm (the register-blocked micro-kernel of Goto & van de Geijn, "Anatomy of
high-performance matrix multiplication", 2008, as BLIS arranges it; written anew here). Threads
split the panels; rows run in blocks of 64 so a block of activations stays in L2. For each panel,
tiles of up to 8 rows keep 8 x 2 vectors of accumulators in registers: per feature pair, two
loads of the panel, then for each row a broadcast of its 4 bytes of activations and two dot
instructions (products exact in float32, summed in float32). While a block's tiles walk one
panel, they prefetch the thread's next panel into L2, a few lines per tile. Results (plus the
bias, in float32) are rounded to bfloat16 once, to nearest-even, as oneDNN does, or kept in
float32 where the caller asks (the LM head's logits).

Used where the CPU has AVX512_BF16 and AVX512_VNNI (in the ``amx`` variant with AMX tiles for
weights whose ``K`` is a multiple of 32: ``c-kernels/amx.c``), for weights with ``N`` a multiple
of 32 and ``K`` even, with bfloat16 activations; ``pdserve.layers.linear`` falls back to oneDNN
otherwise. Built by ``pdserve.layers.native``; ``load_cpu_gemm`` returns None without a C compiler
or such a CPU.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.layers.native import kernel_library, per_variant

PANEL = 32  # output columns per panel

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _panels(w: torch.Tensor, group: int, halves: bool) -> torch.Tensor:
    """``w`` ``[N, K]`` → ``[N / 32, K / group, 32, group]`` (see ``PanelWeight``)."""
    n, k = w.shape
    if halves:  # [rows 16j..16j+15 of the first half, the same rows of the second half] for each j
        w = w.reshape(2, n // PANEL, PANEL // 2, k).transpose(0, 1)
    return w.reshape(n // PANEL, PANEL, k // group, group).permute(0, 2, 1, 3).contiguous()


class PanelWeight:
    """A bfloat16 weight ``W`` ``[N, K]`` packed for ``CpuGemm``, in panels of 32 output columns:
    ``data`` ``[N / 32, K / 2, 32, 2]``.

    With ``halves``, panel ``j`` holds rows ``16j..16j+15`` of each half of ``W`` (a merged
    ``[gate; up]`` weight), so that ``silu_and_mul`` can combine a gate row with its up row in the
    epilogue; ``matmul`` gives the same result in either layout.
    """

    def __init__(self, gemm: CpuGemm, data: torch.Tensor, halves: bool):
        panels, steps, _, group = data.shape
        self._gemm = gemm
        self.data, self.halves = data, halves
        self.out_features, self.in_features = panels * PANEL, steps * group

    def to_halves(self) -> PanelWeight:
        """The same weight in the ``halves`` layout (for ``silu_and_mul``)."""
        if self.halves:
            return self
        rows = self.data.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)
        return PanelWeight(self._gemm, _panels(rows, 2, True), True)

    def matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``F.linear(x, W, bias)`` for bfloat16 ``x`` ``[..., K]`` (unit stride along ``K``) and
        bias ``[N]`` or None: a new ``[..., N]`` of ``out_dtype``, bfloat16 (the default: rounded
        once from the float32 sums) or float32 (the sums themselves).

        Raises:
            TypeError: ``x`` is not bfloat16, or ``out_dtype`` is neither bfloat16 nor float32.
        """
        return self._run(x, bias, silu=False, out_dtype=out_dtype or torch.bfloat16)

    def silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``silu(gate) * up`` of ``[gate | up] = F.linear(x, W, bias)``: ``[..., N / 2]``, rounded as
        the two separate ops round (``halves`` layout only).

        Raises:
            TypeError: ``x`` is not bfloat16.
            ValueError: the weight was not packed with ``halves``.
        """
        if not self.halves:
            raise ValueError("silu_and_mul needs a weight packed with halves=True")
        return self._run(x, bias, silu=True, out_dtype=torch.bfloat16)

    def _run(
        self, x: torch.Tensor, bias: torch.Tensor | None, silu: bool, out_dtype: torch.dtype
    ) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"the CPU matmul takes bfloat16 activations, got {x.dtype}")
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"the CPU matmul writes bfloat16 or float32, not {out_dtype}")
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        n, k, m = self.out_features, self.in_features, rows.shape[0]
        out_features = n // 2 if silu else n
        out = torch.empty(m, out_features, dtype=out_dtype)
        if m:
            bias_ptr = None
            if bias is not None:
                bias = bias.to(torch.bfloat16).contiguous()
                bias_ptr = bias.data_ptr()
            out_f32 = out_dtype == torch.float32
            threads = torch.get_num_threads()
            shape_args = (out.data_ptr(), out_features, out_f32, m, n, k, self.halves, silu, threads)
            status = self._gemm.bf16_fn(
                rows.data_ptr(), rows.stride(0), self.data.data_ptr(), bias_ptr, *shape_args
            )
            if status:
                raise MemoryError(f"CPU matmul (bf16, {m} x {k}): no memory for a copy of its last rows")
        return out.view(*shape[:-1], out_features)


class CpuGemm:
    """The built kernel: ``pack`` a bfloat16 weight."""

    def __init__(self, lib: ctypes.CDLL):
        self.bf16_fn = lib.gemm_bf16
        shape_args = [_P, _I, _C, _C, _C, _C, _C, _C, _C]  # out, ldc, out_f32, M, N, K, halves, silu, threads
        self.bf16_fn.restype, self.bf16_fn.argtypes = _C, [_P, _I, _P, _P, *shape_args]

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        """Whether ``weight`` ``[N, K]`` can be packed: on CPU, ``N % 32 == 0`` and ``K`` even."""
        n, k = weight.shape
        return weight.device.type == "cpu" and n % PANEL == 0 and k % 2 == 0

    def pack(self, weight: torch.Tensor, halves: bool = False) -> PanelWeight:
        """Pack a bfloat16 ``weight`` ``[N, K]`` (``supports(weight)``)."""
        return PanelWeight(self, _panels(weight.detach().to(torch.bfloat16), 2, halves), halves)


@per_variant
def load_cpu_gemm(variant: str) -> CpuGemm | None:
    """The kernel of the selected variant (``pdserve.layers.native``); None when the kernels are off
    or the variant lacks it (no AVX512_BF16 and AVX512_VNNI)."""
    lib = kernel_library(variant)
    return CpuGemm(lib) if lib.gemm_supported() else None
