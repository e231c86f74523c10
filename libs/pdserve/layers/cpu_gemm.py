"""Matmuls for CPUs with AVX512-BF16 and AVX512-VNNI: a small OpenMP C kernel over weights packed once
at load, bfloat16 (``vdpbf16ps``) or int8 (``vpdpbusd``, for ``--quantization w8a8_int8``).

At decode batch sizes a linear layer reads its whole weight from memory for a few dozen rows of
activations, and the next layer's weight is never in cache (SmolLM2-135M: 270 MB of weights per
step against 32 MB of L3). oneDNN's bfloat16 matmul computes near the cores' peak once its weight
is cached, but does not overlap fetching a cold weight with arithmetic: a batch-64 decoder layer's
four matmuls took 20-35% longer with their weights cold than warm. This kernel asks for the
next weight panel while it computes the current one, so the fetch hides behind arithmetic (a
batch-64 step's decoder matmuls: ~34 ms here against ~43-48 ms through oneDNN's packed weights,
cold, on a 2-core AMD EPYC with AVX512-BF16; ``benchmarks/engine.py`` shows the whole step). Its
epilogue also does what would otherwise be separate passes: SiLU-and-mul after gate/up, and the
int8 path's dequantization (oneDNN's int8 GEMM needed a quantize, a GEMM and a dequantize call).

Layout: a weight ``W`` ``[N, K]`` is packed into panels of 32 output columns, ``[N / 32, K / 2,
32, 2]`` (bfloat16) or ``[N / 32, K / 4, 32, 4]`` (int8): for each pair (quad) of input features,
the 32 columns' weights side by side, which is the operand order of ``vdpbf16ps`` (``vpdpbusd``):
a 512-bit register of 16 columns x 2 bfloat16 (4 int8) features. A panel is one contiguous run of
``K * 64`` (``K * 32``) bytes.

Algorithm (the register-blocked micro-kernel of Goto & van de Geijn, "Anatomy of
high-performance matrix multiplication", 2008, as BLIS arranges it; written anew here). Threads
split the panels; rows run in blocks of 64 so a block of activations stays in L2. For each panel,
tiles of up to 8 rows keep 8 x 2 vectors of accumulators in registers: per feature pair (quad),
two loads of the panel, then for each row a broadcast of its 4 bytes of activations and two dot
instructions (bfloat16: products exact in float32, summed in float32; int8: uint8 activations =
int8 + 128 times int8 weights, summed exactly in int32, the offset undone with 128 x the
weight's column sums). While a block's tiles walk one panel, they prefetch the thread's next
panel into L2, a few lines per tile. Results (int8: times the row's and the column's scales;
plus the bias, in float32) are rounded to bfloat16 once, to nearest-even, as oneDNN does.

Used where the CPU has AVX512_BF16 and AVX512_VNNI but not AMX (with AMX, oneDNN's tile kernels
are far faster), for weights with ``N`` a multiple of 32 and ``K`` even (int8: a multiple of 4),
with bfloat16 activations; ``pdserve.layers.linear`` and ``pdserve.layers.quantization`` fall back
to oneDNN otherwise. Built by ``pdserve.layers.native``; ``load_cpu_gemm`` returns None without a
C compiler or such a CPU.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.layers.cpu_fused_ops import load_fused_ops
from pdserve.layers.native import AVX512_BF16, AVX512_EXP, build_library

PANEL = 32  # output columns per panel

_SOURCE = (
    r"""
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && !defined(__AMX_BF16__)
#include <immintrin.h>
#include <omp.h>
"""
    + AVX512_EXP
    + AVX512_BF16
    + r"""

#define INLINE static inline __attribute__((always_inline))
#define PANEL 32   /* output columns per panel: two vectors of 16 float32 */
#define MR 8       /* rows per register tile: 8 x 2 accumulators */
#define MBLOCK 64  /* rows per block: a block of activations stays in L2 */
typedef uint16_t bf16;

int gemm_supported(void) { return 1; }

/* A row's two accumulators (+ biases), rounded: stored at c0 and c1, or with silu, silu(c0's
   values) * c1's values at c0 (silu_mul16_bf16 on the rounded gate and up). */
INLINE void store_row(int silu, __m512 acc0, __m512 acc1, __m512 bias0, __m512 bias1, bf16* c0, bf16* c1) {
  const __m256i lo = round16_bf16(_mm512_add_ps(acc0, bias0));
  const __m256i hi = round16_bf16(_mm512_add_ps(acc1, bias1));
  if (silu) {
    _mm256_storeu_si256((__m256i*)c0, silu_mul16_bf16(bf16_to_f32_16(lo), bf16_to_f32_16(hi)));
  } else {
    _mm256_storeu_si256((__m256i*)c0, lo);
    _mm256_storeu_si256((__m256i*)c1, hi);
  }
}

/* One matmul: activations x [M, K] (bfloat16, or uint8 = int8 + 128 for int8) with a row stride of
   lda bytes; the packed weight; out [M, ldc] bfloat16. int8 only: x_scale [M], w_scale [N] and
   w_comp [N] = 128 * (column sum of the int8 weight), which undoes the activations' offset. */
typedef struct {
  const char* x;
  int64_t lda;
  const char* packed;
  const bf16* bias;
  bf16* out;
  int64_t ldc;
  int M, N, K, halves, silu;
  const float *x_scale, *w_scale;
  const int32_t* w_comp;
} Gemm;

/* Rows m0 .. m0 + rows - 1 (rows <= MR; a constant where inlined, so the accumulators live in
   registers) times panel n, whose two halves are output columns col0 and col1 (16 each). Each
   step reads 128 bytes of the panel (32 columns x 2 bfloat16 or 4 int8 features) and 4 bytes of
   each row; meanwhile the tile prefetches pf_lines cache lines from pf into L2. */
INLINE void tile(const int int8, const int rows, const Gemm* g, int m0, int n, int col0, int col1,
                 const char* pf, int pf_lines) {
  const int steps = int8 ? g->K / 4 : g->K / 2;
  const char* panel = g->packed + (int64_t)n * steps * 128;
  const char* a = g->x + m0 * g->lda;
  __m512 acc[MR][2];
  for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int every = pf_lines > 0 ? (steps + pf_lines - 1) / pf_lines : steps + 1;
  for (int p = 0, line = 0; p < steps; ++p) {
    const __m512i b0 = _mm512_loadu_si512(panel + p * 128);
    const __m512i b1 = _mm512_loadu_si512(panel + p * 128 + 64);
    if (p % every == 0 && line < pf_lines) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) {
      int32_t word;
      memcpy(&word, a + r * g->lda + 4 * p, 4);
      const __m512i av = _mm512_set1_epi32(word);
      if (int8) {
        acc[r][0] = _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(acc[r][0]), av, b0));
        acc[r][1] = _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(acc[r][1]), av, b1));
      } else {
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)av, (__m512bh)b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)av, (__m512bh)b1);
      }
    }
  }
  const __m512 bias0 = g->bias ? load16_bf16(g->bias + col0) : _mm512_setzero_ps();
  const __m512 bias1 = g->bias ? load16_bf16(g->bias + col1) : _mm512_setzero_ps();
  __m512i comp0 = _mm512_setzero_si512(), comp1 = comp0;
  __m512 ws0 = _mm512_setzero_ps(), ws1 = ws0;
  if (int8) {
    comp0 = _mm512_loadu_si512(g->w_comp + col0), comp1 = _mm512_loadu_si512(g->w_comp + col1);
    ws0 = _mm512_loadu_ps(g->w_scale + col0), ws1 = _mm512_loadu_ps(g->w_scale + col1);
  }
  bf16* c = g->out + m0 * g->ldc;
  for (int r = 0; r < rows; ++r) {
    __m512 v0 = acc[r][0], v1 = acc[r][1];
    if (int8) {  /* (sum of (q_x + 128) q_w - 128 sum q_w) * x_scale * w_scale */
      const __m512 xs = _mm512_set1_ps(g->x_scale[m0 + r]);
      const __m512i sum0 = _mm512_sub_epi32(_mm512_castps_si512(v0), comp0);
      const __m512i sum1 = _mm512_sub_epi32(_mm512_castps_si512(v1), comp1);
      v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(sum0), _mm512_mul_ps(xs, ws0));
      v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(sum1), _mm512_mul_ps(xs, ws1));
    }
    store_row(g->silu, v0, v1, bias0, bias1, c + r * g->ldc + col0, c + r * g->ldc + col1);
  }
}

#define TILE_CASE(R)                                    \
  case R:                                               \
    if (int8) tile(1, R, g, m0, n, col0, col1, pf, pf_lines); \
    else tile(0, R, g, m0, n, col0, col1, pf, pf_lines);      \
    break;
static void tile_rows(int int8, int rows, const Gemm* g, int m0, int n, int col0, int col1, const char* pf,
                      int pf_lines) {
  switch (rows) {
    TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
  }
}

/* Threads split the panels; rows go in blocks of MBLOCK, each block in tiles of MR rows. Panel n
   holds weight rows 32n..32n+31, or with halves, rows 16n..16n+15 of each half of W; its output
   columns are the same rows' indices. With silu (halves only; W = [gate; up]) the output is
   silu(gate) * up, [M, N/2], at the gate columns. */
static void run(int int8, const Gemm* g, int threads) {
  const int panels = g->N / PANEL;
  const int panel_lines = g->K * PANEL * (int8 ? 1 : 2) / 64;
  #pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int lo = (int)((int64_t)panels * t / nt), hi = (int)((int64_t)panels * (t + 1) / nt);
    for (int m_lo = 0; m_lo < g->M; m_lo += MBLOCK) {
      const int m_hi = g->M < m_lo + MBLOCK ? g->M : m_lo + MBLOCK;
      const int tiles = (m_hi - m_lo + MR - 1) / MR;
      for (int n = lo; n < hi; ++n) {
        const int col0 = g->halves ? n * PANEL / 2 : n * PANEL;
        const int col1 = g->halves ? g->N / 2 + col0 : col0 + PANEL / 2;
        /* one tile reads its panel once: the hardware prefetcher alone does better there */
        const char* next = tiles > 1 && n + 1 < hi ? g->packed + (int64_t)(n + 1) * panel_lines * 64 : NULL;
        for (int i = 0; i < tiles; ++i) {
          const int m0 = m_lo + i * MR, rows = m_hi - m0 < MR ? m_hi - m0 : MR;
          const int l0 = panel_lines * i / tiles, l1 = panel_lines * (i + 1) / tiles;
          tile_rows(int8, rows, g, m0, n, col0, col1, next ? next + 64 * l0 : NULL, next ? l1 - l0 : 0);
        }
      }
    }
  }
}

/* out = x W^T + bias (or silu(gate) * up) for bfloat16 x [M, K] and W packed as [N/32, K/2, 32, 2]. */
void gemm_bf16(const bf16* x, int64_t lda, const bf16* packed, const bf16* bias, bf16* out, int64_t ldc,
               int M, int N, int K, int halves, int silu, int threads) {
  const Gemm g = {(const char*)x, lda * 2, (const char*)packed, bias, out, ldc, M, N, K, halves, silu,
                  NULL, NULL, NULL};
  run(0, &g, threads);
}

/* The same for int8: x_q [M, K] uint8 (int8 + 128; row stride lda bytes) with x_scale [M], W packed
   as [N/32, K/4, 32, 4] int8 with w_scale [N] and w_comp [N]. */
void gemm_int8(const uint8_t* x_q, int64_t lda, const float* x_scale, const int8_t* packed,
               const float* w_scale, const int32_t* w_comp, const bf16* bias, bf16* out, int64_t ldc,
               int M, int N, int K, int halves, int silu, int threads) {
  const Gemm g = {(const char*)x_q, lda, (const char*)packed, bias, out, ldc, M, N, K, halves, silu,
                  x_scale, w_scale, w_comp};
  run(1, &g, threads);
}
#else
int gemm_supported(void) { return 0; }
#endif
"""
)

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _panels(w: torch.Tensor, group: int, halves: bool) -> torch.Tensor:
    """``w`` ``[N, K]`` → ``[N / 32, K / group, 32, group]`` (see ``PanelWeight``)."""
    n, k = w.shape
    if halves:  # [rows 16j..16j+15 of the first half, the same rows of the second half] for each j
        w = w.reshape(2, n // PANEL, PANEL // 2, k).transpose(0, 1)
    return w.reshape(n // PANEL, PANEL, k // group, group).permute(0, 2, 1, 3).contiguous()


class PanelWeight:
    """A weight ``W`` ``[N, K]`` packed for ``CpuGemm``, in panels of 32 output columns: bfloat16
    ``data`` ``[N / 32, K / 2, 32, 2]``, or int8 ``[N / 32, K / 4, 32, 4]`` with per-column float32
    ``w_scale`` ``[N]`` (``W ≈ q * w_scale``) and ``w_comp`` ``[N]`` = 128 x the column sums of
    ``q`` (which undo the activations' +128 offset).

    With ``halves``, panel ``j`` holds rows ``16j..16j+15`` of each half of ``W`` (a merged
    ``[gate; up]`` weight), so that ``silu_and_mul`` can combine a gate row with its up row in the
    epilogue; ``matmul`` gives the same result in either layout.
    """

    def __init__(self, gemm: CpuGemm, data: torch.Tensor, halves: bool, w_scale=None, w_comp=None):
        panels, steps, _, group = data.shape
        self._gemm = gemm
        self.data, self.halves, self.w_scale, self.w_comp = data, halves, w_scale, w_comp
        self.out_features, self.in_features = panels * PANEL, steps * group

    @property
    def int8(self) -> bool:
        return self.data.dtype == torch.int8

    def to_halves(self) -> PanelWeight:
        """The same weight in the ``halves`` layout (for ``silu_and_mul``)."""
        if self.halves:
            return self
        group = self.data.shape[-1]
        rows = self.data.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)
        return PanelWeight(self._gemm, _panels(rows, group, True), True, self.w_scale, self.w_comp)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, W, bias)`` for bfloat16 ``x`` ``[..., K]`` (unit stride along ``K``) and
        bias ``[N]`` or None: a new bfloat16 ``[..., N]``. int8: ``x`` is quantized per row first
        (symmetric, ``pdserve.layers.cpu_fused_ops.quantize_rows``).

        Raises:
            TypeError: ``x`` is not bfloat16.
        """
        return self._run(x, bias, silu=False)

    def silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``silu(gate) * up`` of ``[gate | up] = F.linear(x, W, bias)``: ``[..., N / 2]``, rounded as
        the two separate ops round (``halves`` layout only).

        Raises:
            TypeError: ``x`` is not bfloat16.
            ValueError: the weight was not packed with ``halves``.
        """
        if not self.halves:
            raise ValueError("silu_and_mul needs a weight packed with halves=True")
        return self._run(x, bias, silu=True)

    def _run(self, x: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"the CPU matmul takes bfloat16 activations, got {x.dtype}")
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        n, k, m = self.out_features, self.in_features, rows.shape[0]
        out_features = n // 2 if silu else n
        out = torch.empty(m, out_features, dtype=torch.bfloat16)
        if m:
            bias_ptr = None
            if bias is not None:
                bias = bias.to(torch.bfloat16).contiguous()
                bias_ptr = bias.data_ptr()
            shape_args = (out.data_ptr(), out_features, m, n, k, self.halves, silu, torch.get_num_threads())
            if self.int8:
                q, x_scale = load_fused_ops().quantize_rows(rows)
                self._gemm.int8_fn(
                    q.data_ptr(), q.stride(0), x_scale.data_ptr(), self.data.data_ptr(),
                    self.w_scale.data_ptr(), self.w_comp.data_ptr(), bias_ptr, *shape_args,
                )  # fmt: skip
            else:
                self._gemm.bf16_fn(
                    rows.data_ptr(), rows.stride(0), self.data.data_ptr(), bias_ptr, *shape_args
                )
        return out.view(*shape[:-1], out_features)


class CpuGemm:
    """The built kernel: ``pack`` a bfloat16 weight, ``pack_int8`` a quantized one."""

    def __init__(self, lib: ctypes.CDLL):
        self.bf16_fn, self.int8_fn = lib.gemm_bf16, lib.gemm_int8
        shape_args = [_P, _I, _C, _C, _C, _C, _C, _C]
        self.bf16_fn.restype, self.bf16_fn.argtypes = None, [_P, _I, _P, _P, *shape_args]
        self.int8_fn.restype, self.int8_fn.argtypes = None, [_P, _I, _P, _P, _P, _P, _P, *shape_args]

    @staticmethod
    def supports(weight: torch.Tensor, int8: bool = False) -> bool:
        """Whether ``weight`` ``[N, K]`` can be packed: on CPU, ``N % 32 == 0``, and ``K`` even
        (bfloat16) or a multiple of 4 (int8)."""
        n, k = weight.shape
        return weight.device.type == "cpu" and n % PANEL == 0 and k % (4 if int8 else 2) == 0

    def pack(self, weight: torch.Tensor, halves: bool = False) -> PanelWeight:
        """Pack a bfloat16 ``weight`` ``[N, K]`` (``supports(weight)``)."""
        return PanelWeight(self, _panels(weight.detach().to(torch.bfloat16), 2, halves), halves)

    def pack_int8(self, weight_q: torch.Tensor, w_scale: torch.Tensor) -> PanelWeight:
        """Pack int8 ``weight_q`` ``[N, K]`` with float32 scales ``[N]`` (``supports(weight_q, True)``)."""
        comp = weight_q.sum(dim=1, dtype=torch.int32) * 128
        return PanelWeight(self, _panels(weight_q, 4, False), False, w_scale.float().contiguous(), comp)


@functools.cache
def load_cpu_gemm() -> CpuGemm | None:
    """Build (once per source and CPU) and load the kernel; None without a C compiler, or on a CPU
    without AVX512_BF16 and AVX512_VNNI or with AMX (where oneDNN is the better matmul)."""
    lib = build_library("cpu_gemm", _SOURCE)
    if lib is None or not lib.gemm_supported():
        return None
    return CpuGemm(lib)
