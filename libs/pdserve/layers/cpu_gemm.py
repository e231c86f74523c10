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

from pdserve.layers.native import build_library

PANEL = 32  # output columns per panel

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#include <immintrin.h>
#include <omp.h>

#define INLINE static inline __attribute__((always_inline))
#define PANEL 32   /* output columns per panel: two vectors of 16 float32 */
#define MR 8       /* rows per register tile: 8 x 2 accumulators */
#define MBLOCK 64  /* rows per block: a block of activations stays in L2 */
typedef uint16_t bf16;

int gemm_supported(void) { return 1; }

INLINE __m512 bf16x16_to_f32(const bf16* p) {
  const __m256i v = _mm256_loadu_si256((const __m256i*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* c[r, 0:32] = a[r, :] . panel + bias for r < rows (rows <= MR; a constant where inlined, so the
   accumulators live in registers). Meanwhile prefetches pf_lines cache lines from pf into L2,
   spread over the feature pairs. */
INLINE void tile(const int rows, const bf16* a, int64_t lda, const bf16* panel, int pairs,
                 const bf16* bias, bf16* c, int64_t ldc, const char* pf, int pf_lines) {
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
  __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
  if (bias) { bias0 = bf16x16_to_f32(bias); bias1 = bf16x16_to_f32(bias + 16); }
  for (int r = 0; r < rows; ++r) {
    const __m256bh lo = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][0], bias0));
    const __m256bh hi = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][1], bias1));
    _mm256_storeu_si256((__m256i*)(c + r * ldc), (__m256i)lo);
    _mm256_storeu_si256((__m256i*)(c + r * ldc + 16), (__m256i)hi);
  }
}

#define TILE_CASE(R) case R: tile(R, a, lda, panel, pairs, bias, c, ldc, pf, pf_lines); break;
static void tile_rows(int rows, const bf16* a, int64_t lda, const bf16* panel, int pairs,
                      const bf16* bias, bf16* c, int64_t ldc, const char* pf, int pf_lines) {
  switch (rows) {
    TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
  }
}

/* out [M, N] (row stride ldc) = x [M, K] (row stride lda) W^T + bias; packed: [N/32, K/2, 32, 2];
   bias: NULL or [N]. */
void gemm_bf16(const bf16* x, int64_t lda, const bf16* packed, const bf16* bias, bf16* out, int64_t ldc,
               int M, int N, int K, int threads) {
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
        /* one tile reads its panel once: the hardware prefetcher alone does better there */
        const char* next = tiles > 1 && n + 1 < hi ? (const char*)(panel + panel_elems) : NULL;
        for (int i = 0; i < tiles; ++i) {
          const int m0 = m_lo + i * MR, rows = m_hi - m0 < MR ? m_hi - m0 : MR;
          const int l0 = panel_lines * i / tiles, l1 = panel_lines * (i + 1) / tiles;
          tile_rows(rows, x + m0 * lda, lda, panel, pairs, bias ? bias + n * PANEL : NULL,
                    out + m0 * ldc + n * PANEL, ldc, next ? next + 64 * l0 : NULL, next ? l1 - l0 : 0);
        }
      }
    }
  }
}
#else
int gemm_supported(void) { return 0; }
#endif
"""

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class PanelWeight:
    """A bfloat16 weight ``[N, K]`` packed for ``BF16Gemm``: ``data`` ``[N / 32, K / 2, 32, 2]``.

    ``matmul(x, bias)`` is ``F.linear(x, W, bias)`` for bfloat16 ``x`` ``[..., K]`` (any row
    stride, unit stride along ``K``) and bias ``[N]`` or None; it returns a new ``[..., N]``.

    Raises:
        TypeError: ``x`` is not bfloat16.
    """

    def __init__(self, fn: ctypes._CFuncPtr, weight: torch.Tensor):
        n, k = weight.shape
        self._fn = fn
        self.out_features, self.in_features = n, k
        self.data = weight.detach().reshape(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"bfloat16 weights need bfloat16 activations, got {x.dtype}")
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.bfloat16)
        if rows.shape[0]:
            bias_ptr = None
            if bias is not None:
                bias = bias.to(torch.bfloat16).contiguous()
                bias_ptr = bias.data_ptr()
            n, k = self.out_features, self.in_features
            self._fn(
                rows.data_ptr(), rows.stride(0), self.data.data_ptr(), bias_ptr, out.data_ptr(), n,
                rows.shape[0], n, k, torch.get_num_threads(),
            )  # fmt: skip
        return out.view(*shape[:-1], self.out_features)


class BF16Gemm:
    """The built kernel: ``supports(weight)`` and ``pack(weight)`` → ``PanelWeight``."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.gemm_bf16
        self._fn.restype, self._fn.argtypes = None, [_P, _I, _P, _P, _P, _I, _C, _C, _C, _C]

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        """Whether ``weight`` (``[N, K]``) can be packed: bfloat16 on CPU, ``N % 32 == 0``, ``K`` even."""
        n, k = weight.shape
        on_cpu = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        return on_cpu and n % PANEL == 0 and k % 2 == 0

    def pack(self, weight: torch.Tensor) -> PanelWeight:
        return PanelWeight(self._fn, weight)


@functools.cache
def load_bf16_gemm() -> BF16Gemm | None:
    """Build (once per source and CPU) and load the kernel; None without a C compiler, or on a CPU
    without AVX512_BF16 or with AMX (where oneDNN is the better matmul)."""
    lib = build_library("bf16_gemm", _SOURCE)
    if lib is None or not lib.gemm_supported():
        return None
    return BF16Gemm(lib)
