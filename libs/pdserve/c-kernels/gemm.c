/* Matmuls on bfloat16 weights packed once at load (see pdserve/layers/cpu_gemm.py): the AVX512-BF16
   kernel over weight panels, and in the `amx` variant AMX tiles for weights whose K is a multiple of
   32 (at every M: see amx.c). */
#include "amx.h"
#include "common.h"

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)

#define PANEL 32   /* output columns per panel: two vectors of 16 float32 */
#define MR 8       /* rows per register tile: 8 x 2 accumulators */
#define MBLOCK 64  /* rows per block: a block of activations stays in L2 */

int gemm_supported(void) { return 1; }

/* A row's two accumulators (+ biases) stored at c0 and c1: as they are (out_f32), or rounded to
   bfloat16; with silu (never with out_f32), silu(c0's values) * c1's values at c0 (silu_mul16_bf16
   on the rounded gate and up). Never inlined: one copy for every tile size and the AMX path, so a
   row's result cannot depend on its tile (see matmul.h's store_row_f32). */
static __attribute__((noinline)) void store_row(int silu, int out_f32, __m512 acc0, __m512 acc1, __m512 bias0, __m512 bias1, char* c0,
                      char* c1) {
  const __m512 v0 = _mm512_add_ps(acc0, bias0), v1 = _mm512_add_ps(acc1, bias1);
  if (out_f32) {
    _mm512_storeu_ps(c0, v0);
    _mm512_storeu_ps(c1, v1);
    return;
  }
  const __m256i lo = round16_bf16(v0), hi = round16_bf16(v1);
  if (silu) {
    _mm256_storeu_si256((__m256i*)c0, silu_mul16_bf16(bf16_to_f32_16(lo), bf16_to_f32_16(hi)));
  } else {
    _mm256_storeu_si256((__m256i*)c0, lo);
    _mm256_storeu_si256((__m256i*)c1, hi);
  }
}

/* One matmul: bfloat16 activations x [M, K] with a row stride of lda bytes; the packed weight; out
   [M, ldc] bfloat16, or float32 with out_f32. */
typedef struct {
  const char* x;
  int64_t lda;
  const char* packed;
  const bf16* bias;
  void* out;
  int64_t ldc;
  int out_f32, M, N, K, halves, silu;
} Gemm;

/* Rows m0 .. m0 + rows - 1 (rows <= MR; a constant where inlined, so the accumulators live in
   registers) times panel n, whose two halves are output columns col0 and col1 (16 each). Each
   step reads 128 bytes of the panel (32 columns x 2 bfloat16 features) and 4 bytes of each row;
   meanwhile the tile prefetches pf_lines cache lines from pf into L2. */
INLINE void tile(const int rows, const Gemm* g, int m0, int n, int col0, int col1, const char* pf,
                 int pf_lines) {
  const int steps = g->K / 2;
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
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)av, (__m512bh)b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)av, (__m512bh)b1);
    }
  }
  const __m512 bias0 = g->bias ? load16_bf16(g->bias + col0) : _mm512_setzero_ps();
  const __m512 bias1 = g->bias ? load16_bf16(g->bias + col1) : _mm512_setzero_ps();
  const int64_t e = g->out_f32 ? 4 : 2; /* bytes per output */
  char* c = (char*)g->out + m0 * g->ldc * e;
  for (int r = 0; r < rows; ++r) {
    char* row = c + r * g->ldc * e;
    store_row(g->silu, g->out_f32, acc[r][0], acc[r][1], bias0, bias1, row + col0 * e, row + col1 * e);
  }
}

#define TILE_CASE(R)                                \
  case R:                                           \
    tile(R, g, m0, n, col0, col1, pf, pf_lines);    \
    break;
static void tile_rows(int rows, const Gemm* g, int m0, int n, int col0, int col1, const char* pf,
                      int pf_lines) {
  switch (rows) {
    TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
  }
}

/* Threads split the panels; rows go in blocks of MBLOCK, each block in tiles of MR rows. Panel n
   holds weight rows 32n..32n+31, or with halves, rows 16n..16n+15 of each half of W; its output
   columns are the same rows' indices. With silu (halves only; W = [gate; up]) the output is
   silu(gate) * up, [M, N/2], at the gate columns. */
#ifdef __AMX_BF16__
/* The AMX path, thread t's panels: blocks of 32 rows times a panel (amx_bf16_block), the last block's
   rows copied into tail [32, K] (zeros past M), then the vector path's epilogue for each row. */
typedef struct {
  const Gemm* g;
  const bf16* tail;
} AmxRun;
static void amx_panels(const void* ctx, int t, int nt) {
  const Gemm* g = ((const AmxRun*)ctx)->g;
  const bf16* tail = ((const AmxRun*)ctx)->tail;
  const int panels = g->N / PANEL;
  const int64_t lda = g->lda / 2, e = g->out_f32 ? 4 : 2, full = g->M / 32 * 32;
  const int lo = (int)((int64_t)panels * t / nt), hi = (int)((int64_t)panels * (t + 1) / nt);
  float sums[32][32] __attribute__((aligned(64)));
  amx_configure(AMX_BF16);
  for (int m_lo = 0; m_lo < g->M; m_lo += MBLOCK) {
    const int m_hi = g->M < m_lo + MBLOCK ? g->M : m_lo + MBLOCK;
    for (int n = lo; n < hi; ++n) {
      const int col0 = g->halves ? n * PANEL / 2 : n * PANEL;
      const int col1 = g->halves ? g->N / 2 + col0 : col0 + PANEL / 2;
      const bf16* panel = (const bf16*)g->packed + (int64_t)n * g->K * PANEL;
      const __m512 bias0 = g->bias ? load16_bf16(g->bias + col0) : _mm512_setzero_ps();
      const __m512 bias1 = g->bias ? load16_bf16(g->bias + col1) : _mm512_setzero_ps();
      for (int m0 = m_lo; m0 < m_hi; m0 += 32) {
        if (m0 < full) amx_bf16_block((const bf16*)g->x + m0 * lda, lda, panel, g->K, sums);
        else amx_bf16_block(tail, g->K, panel, g->K, sums);
        for (int r = 0; r < 32 && m0 + r < g->M; ++r) {
          char* row = (char*)g->out + (m0 + r) * g->ldc * e;
          store_row(g->silu, g->out_f32, _mm512_load_ps(sums[r]), _mm512_load_ps(sums[r] + 16), bias0, bias1,
                    row + col0 * e, row + col1 * e);
        }
      }
    }
  }
  amx_release();
}
#endif

static void vector_panels(const void* ctx, int t, int nt) {
  const Gemm* g = ctx;
  const int panels = g->N / PANEL;
  const int panel_lines = g->K * PANEL * 2 / 64;
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
        tile_rows(rows, g, m0, n, col0, col1, next ? next + 64 * l0 : NULL, next ? l1 - l0 : 0);
      }
    }
  }
}

/* out = x W^T + bias (or silu(gate) * up) for bfloat16 x [M, K] and W packed as [N/32, K/2, 32, 2];
   out bfloat16, or float32 with out_f32 (not with silu). Returns 0, or -1 when out of memory (the
   AMX path's copy of the last rows). */
int gemm_bf16(const bf16* x, int64_t lda, const bf16* packed, const bf16* bias, void* out, int64_t ldc,
               int out_f32, int M, int N, int K, int halves, int silu, int threads) {
  const Gemm g = {(const char*)x, lda * 2, (const char*)packed, bias, out, ldc, out_f32, M, N, K, halves,
                  silu};
#ifdef __AMX_BF16__
  if (K % 32 == 0) {
    const int64_t full = M / 32 * 32;
    bf16* tail = M > full ? calloc(32 * (int64_t)K, sizeof(bf16)) : NULL;
    if (M > full && !tail) return -1;
    for (int64_t r = full; r < M; ++r) memcpy(tail + (r - full) * K, x + r * lda, K * sizeof(bf16));
    const AmxRun args = {&g, tail};
    run_threads(threads, amx_panels, &args);
    free(tail);
    return 0;
  }
#endif
  run_threads(threads, vector_panels, &g);
  return 0;
}
#else
int gemm_supported(void) { return 0; }
#endif
