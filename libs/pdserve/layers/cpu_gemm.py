"""bfloat16 matmuls for CPUs with AVX512-BF16: a small OpenMP C kernel over weights packed once at load.

At decode batch sizes a linear layer reads its whole weight from memory for a few dozen rows of
activations, and the next layer's weight is never in cache (SmolLM2-135M: 270 MB of weights per
step against 32 MB of L3). oneDNN's bfloat16 matmul computes near the cores' peak once its weight
is cached, but does not overlap fetching a cold weight with arithmetic: a batch-64 decoder layer's
four matmuls took 20-35% longer with their weights cold than warm. This kernel asks for the
next weight panel while it computes the current one, so the fetch hides behind arithmetic (a
batch-64 step's decoder matmuls: ~34 ms here against ~43-48 ms through oneDNN's packed weights,
cold, on a 2-core AMD EPYC with AVX512-BF16; ``benchmarks/engine.py`` shows the whole step).

Layout: a weight ``W`` ``[N, K]`` is packed into panels of 32 output columns, ``[N / 32, K / 2,
32, 2]``: for each pair of input features ``(2p, 2p + 1)``, the 32 columns' two weights side by
side, which is the operand order of ``vdpbf16ps`` (a 512-bit register of 16 columns x 2 features).
A panel is one contiguous run of ``K * 64`` bytes.

Algorithm (the register-blocked micro-kernel of Goto & van de Geijn, "Anatomy of
high-performance matrix multiplication", 2008, as BLIS arranges it; written anew here). Threads
split the panels; rows run in blocks of 64 so a block of activations stays in L2. For each panel,
tiles of up to 8 rows keep 8 x 2 vectors of float32 accumulators in registers: per feature pair,
two loads of the panel, then for each row a broadcast of its two activations and two
``vdpbf16ps`` (products exact in float32, summed in float32). While a block's tiles walk one
panel, they prefetch the thread's next panel into L2, a few lines per tile. Results (plus the
bias, in float32) are rounded to bfloat16 once, to nearest-even, as oneDNN does.

Used where the CPU has AVX512_BF16 but not AMX (with AMX, oneDNN's tile kernels are far faster),
for weights with ``N`` a multiple of 32 and ``K`` even; ``pdserve.layers.linear`` falls back to
oneDNN otherwise. Built by ``pdserve.layers.native``; ``load_bf16_gemm`` returns None without a C
compiler or such a CPU.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.layers.native import AVX512_EXP, build_library

PANEL = 32  # output columns per panel

_SOURCE = (
    r"""
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#include <immintrin.h>
#include <omp.h>
"""
    + AVX512_EXP
    + r"""

#define INLINE static inline __attribute__((always_inline))
#define PANEL 32   /* output columns per panel: two vectors of 16 float32 */
#define MR 8       /* rows per register tile: 8 x 2 accumulators */
#define MBLOCK 64  /* rows per block: a block of activations stays in L2 */
typedef uint16_t bf16;

int gemm_supported(void) { return 1; }

INLINE __m512 bf16x16_to_f32(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
INLINE __m512 load_bf16x16(const bf16* p) { return bf16x16_to_f32(_mm256_loadu_si256((const __m256i*)p)); }
INLINE __m256i round_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }  /* nearest-even */

/* A row's two accumulators (+ biases), rounded: stored at c0 and c1, or with silu, silu(c0's
   values) * c1's values at c0, rounded where Hugging Face's bfloat16 modules round (gate and up,
   silu(gate), the product). */
INLINE void store_row(int silu, __m512 acc0, __m512 acc1, __m512 bias0, __m512 bias1, bf16* c0, bf16* c1) {
  const __m256i lo = round_bf16x16(_mm512_add_ps(acc0, bias0));
  const __m256i hi = round_bf16x16(_mm512_add_ps(acc1, bias1));
  if (!silu) {
    _mm256_storeu_si256((__m256i*)c0, lo);
    _mm256_storeu_si256((__m256i*)c1, hi);
    return;
  }
  const __m512 gate = bf16x16_to_f32(lo);
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate));
  const __m512 act = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  const __m512 product = _mm512_mul_ps(bf16x16_to_f32(round_bf16x16(act)), bf16x16_to_f32(hi));
  _mm256_storeu_si256((__m256i*)c0, round_bf16x16(product));
}

/* Rows r < rows (<= MR; a constant where inlined, so the accumulators live in registers) of a
   times one panel, stored by store_row at c0 / c1 + r * ldc; bias0 / bias1: the bias of the
   panel's two halves (NULL: none). Meanwhile prefetches pf_lines cache lines from pf into L2, spread over the
   feature pairs. */
INLINE void tile(const int rows, const bf16* a, int64_t lda, const bf16* panel, int pairs, int silu,
                 const bf16* bias0, const bf16* bias1, bf16* c0, bf16* c1, int64_t ldc, const char* pf,
                 int pf_lines) {
  __m512 acc[MR][2];
  for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int every = pf_lines > 0 ? (pairs + pf_lines - 1) / pf_lines : pairs + 1;
  for (int p = 0, line = 0; p < pairs; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * PANEL);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * PANEL + PANEL);
    if (p % every == 0 && line < pf_lines) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) {
      int32_t pair;
      memcpy(&pair, a + r * lda + 2 * p, 4);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
    }
  }
  const __m512 add0 = bias0 ? load_bf16x16(bias0) : _mm512_setzero_ps();
  const __m512 add1 = bias1 ? load_bf16x16(bias1) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r)
    store_row(silu, acc[r][0], acc[r][1], add0, add1, c0 + r * ldc, c1 + r * ldc);
}

#define TILE_CASE(R) \
  case R: tile(R, a, lda, panel, pairs, silu, bias0, bias1, c0, c1, ldc, pf, pf_lines); break;
static void tile_rows(int rows, const bf16* a, int64_t lda, const bf16* panel, int pairs, int silu,
                      const bf16* bias0, const bf16* bias1, bf16* c0, bf16* c1, int64_t ldc, const char* pf,
                      int pf_lines) {
  switch (rows) {
    TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
  }
}

/* x [M, K] (row stride lda) times W [N, K] packed as [N/32, K/2, 32, 2]; bias: NULL or [N]. Panel
   j holds rows 32j..32j+31 of W, or with halves, rows 16j..16j+15 of each half of W.
   out [M, N] (row stride ldc) = x W^T + bias; with silu (and halves; W = [gate; up]):
   out [M, N/2] = silu(gate) * up. */
void gemm_bf16(const bf16* x, int64_t lda, const bf16* packed, const bf16* bias, bf16* out, int64_t ldc,
               int M, int N, int K, int halves, int silu, int threads) {
  const int pairs = K / 2, panels = N / PANEL;
  const int64_t panel_elems = (int64_t)K * PANEL;
  const int panel_lines = (int)(panel_elems * 2 / 64);
  #pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int lo = (int)((int64_t)panels * t / nt), hi = (int)((int64_t)panels * (t + 1) / nt);
    for (int m_lo = 0; m_lo < M; m_lo += MBLOCK) {
      const int m_hi = M < m_lo + MBLOCK ? M : m_lo + MBLOCK;
      const int tiles = (m_hi - m_lo + MR - 1) / MR;
      for (int n = lo; n < hi; ++n) {
        const bf16* panel = packed + n * panel_elems;
        const int col0 = halves ? n * PANEL / 2 : n * PANEL, col1 = halves ? N / 2 + col0 : col0 + PANEL / 2;
        const bf16* bias0 = bias ? bias + col0 : NULL;
        const bf16* bias1 = bias ? bias + col1 : NULL;
        /* one tile reads its panel once: the hardware prefetcher alone does better there */
        const char* next = tiles > 1 && n + 1 < hi ? (const char*)(panel + panel_elems) : NULL;
        for (int i = 0; i < tiles; ++i) {
          const int m0 = m_lo + i * MR, rows = m_hi - m0 < MR ? m_hi - m0 : MR;
          const int l0 = panel_lines * i / tiles, l1 = panel_lines * (i + 1) / tiles;
          tile_rows(rows, x + m0 * lda, lda, panel, pairs, silu, bias0, bias1, out + m0 * ldc + col0,
                    out + m0 * ldc + col1, ldc, next ? next + 64 * l0 : NULL, next ? l1 - l0 : 0);
        }
      }
    }
  }
}
#else
int gemm_supported(void) { return 0; }
#endif
"""
)

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class PanelWeight:
    """A bfloat16 weight ``[N, K]`` packed for ``BF16Gemm``: ``data`` ``[N / 32, K / 2, 32, 2]``.

    With ``halves``, panel ``j`` holds rows ``16j..16j+15`` of each half of ``W`` (a merged
    ``[gate; up]`` weight), so that ``silu_and_mul`` can combine a gate row with its up row in the
    epilogue; ``matmul`` gives the same result in either layout.

    Args:
        fn: the kernel's ``gemm_bf16``.
        weight: bfloat16 ``[N, K]``, ``N`` a multiple of 32 and ``K`` even.
        halves: the layout above.
    """

    def __init__(self, fn: ctypes._CFuncPtr, weight: torch.Tensor, halves: bool = False):
        n, k = weight.shape
        self._fn = fn
        self.out_features, self.in_features, self.halves = n, k, halves
        w = weight.detach()
        if halves:  # [gate rows 16j..16j+15, up rows 16j..16j+15] for each j
            w = w.reshape(2, n // PANEL, PANEL // 2, k).transpose(0, 1)
        self.data = w.reshape(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, W, bias)`` for bfloat16 ``x`` ``[..., K]`` (unit stride along ``K``) and
        bias ``[N]`` or None: a new ``[..., N]``.

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
            raise TypeError(f"bfloat16 weights need bfloat16 activations, got {x.dtype}")
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        n, k = self.out_features, self.in_features
        out_features = n // 2 if silu else n
        out = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
        if rows.shape[0]:
            bias_ptr = None
            if bias is not None:
                bias = bias.to(torch.bfloat16).contiguous()
                bias_ptr = bias.data_ptr()
            self._fn(
                rows.data_ptr(), rows.stride(0), self.data.data_ptr(), bias_ptr, out.data_ptr(), out_features,
                rows.shape[0], n, k, self.halves, silu, torch.get_num_threads(),
            )  # fmt: skip
        return out.view(*shape[:-1], out_features)


class BF16Gemm:
    """The built kernel: ``supports(weight)`` and ``pack(weight, halves)`` → ``PanelWeight``."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.gemm_bf16
        self._fn.restype, self._fn.argtypes = None, [_P, _I, _P, _P, _P, _I, _C, _C, _C, _C, _C, _C]

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        """Whether ``weight`` (``[N, K]``) can be packed: bfloat16 on CPU, ``N % 32 == 0``, ``K`` even."""
        n, k = weight.shape
        on_cpu = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        return on_cpu and n % PANEL == 0 and k % 2 == 0

    def pack(self, weight: torch.Tensor, halves: bool = False) -> PanelWeight:
        return PanelWeight(self._fn, weight, halves)


@functools.cache
def load_bf16_gemm() -> BF16Gemm | None:
    """Build (once per source and CPU) and load the kernel; None without a C compiler, or on a CPU
    without AVX512_BF16 or with AMX (where oneDNN is the better matmul)."""
    lib = build_library("bf16_gemm", _SOURCE)
    if lib is None or not lib.gemm_supported():
        return None
    return BF16Gemm(lib)
