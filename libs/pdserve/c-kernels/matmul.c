/* Matmuls for any x86-64 CPU over weights packed once at load (see pdserve/layers/cpu_matmul.py):
   float activations against float32, bfloat16, int8 (per output column) or int4 (per group of 32
   inputs, with a minimum) weight panels, and an exact int8 x int8 matmul (W8A8).

   Panels hold NR = 16 output columns (two AVX2 vectors of float32); a panel is one contiguous run:
     W_F32  [K, 16] float32          W_BF16 [K, 16] bfloat16          W_I8 [K, 16] int8
     W_I4   [K, 8] bytes: byte j of input k holds column j (low nibble) and column j + 8 (high),
            unsigned 0..15; scales and mins [N / 16, K / 32, 16] float16: w = q * scale + min
     W_I8G  [K, 16] int8 with scales [N / 16, K / 32, 16] float16: w = q * scale (llama.cpp's Q8_0)
     W8A8   [K / 2, 16, 2] int8: for each pair of inputs, the 16 columns' two weights side by side
            (the operand order of vpmaddwd once widened to int16).
   Float path (Goto & van de Geijn's register-blocked micro-kernel, written anew): threads split the
   panels; rows run in blocks of MBLOCK, tiles of up to MR rows keep MR x 2 vectors of float32
   accumulators; per input k, the panel's 16 weights are widened / dequantized in registers and
   each row's activation broadcast into two FMAs. A block of more than two tiles first dequantizes
   the panel into a float32 buffer (the same values), so each weight is converted once per block.
   int8 weights: the column scale multiplies the finished sum (sum x q s = s sum x q). Sums in
   float32 in input order; outputs float32 or bfloat16 (rounded once, to nearest-even).
   W8A8: each row of activations is quantized symmetrically to int8 (x ~ q * max|x| / 127, round
   half to even), widened to int16, and vpmaddwd sums pairs of int16 products exactly in int32
   (no saturation: the AVX2 u8 x s8 instruction would saturate its int16 pair sums), then
   out = sum * x_scale * w_scale (+ bias).
   Epilogues: bias, and SiLU-and-mul for a [gate; up] weight packed in halves (panel j: gate columns
   8j..8j+7, then the same up columns), out = silu(gate) * up, rounded as Hugging Face rounds. */
#include "matmul.h"

#include "quantize.h"

enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2, W_I4 = 3, W_I8G = 4 };
#define GROUPED(format) ((format) == W_I4 || (format) == W_I8G) /* scales per group of inputs */
#define MR 6       /* rows per register tile: 6 x 2 accumulators */
#define MBLOCK 48  /* rows per block: a block of activations stays in L2 */
#define MR_W8A8 4  /* W8A8: each product needs a register of its own before the add */

static int64_t panel_bytes(int format, int64_t K) {
  return format == W_F32 ? K * 64 : format == W_BF16 ? K * 32 : format == W_I4 ? K * 8 : K * 16;
}

/* W[k][j] of a panel in float32 (the portable path and the dequantizing copy). */
INLINE float weight_at(int format, const char* panel, const f16* scale, const f16* mins, int64_t k, int j) {
  switch (format) {
    case W_F32: return ((const float*)panel)[k * NR + j];
    case W_BF16: return bf16_to_f32(((const bf16*)panel)[k * NR + j]);
    case W_I8: return (float)((const int8_t*)panel)[k * NR + j];
    case W_I8G: return (float)((const int8_t*)panel)[k * NR + j] * f16_to_f32(scale[k / GROUP * NR + j]);
    default: {
      const uint8_t byte = ((const uint8_t*)panel)[k * 8 + j % 8];
      const float q = (float)(j < 8 ? byte & 15 : byte >> 4);
      const int64_t s = k / GROUP * NR + j;
      return q * f16_to_f32(scale[s]) + f16_to_f32(mins[s]);
    }
  }
}

#ifdef __AVX2__
/* The 16 weights of input k as two float32 vectors; grouped formats: with their group's scales
   (s0, s1) and int4's minimums (m0, m1), already widened. */
INLINE void load_weights(int format, const char* panel, int64_t k, __m256 s0, __m256 s1, __m256 m0, __m256 m1,
                         __m256* w0, __m256* w1) {
  if (format == W_F32) {
    *w0 = _mm256_loadu_ps((const float*)panel + k * NR);
    *w1 = _mm256_loadu_ps((const float*)panel + k * NR + 8);
  } else if (format == W_BF16) {
    *w0 = load8_bf16((const bf16*)panel + k * NR);
    *w1 = load8_bf16((const bf16*)panel + k * NR + 8);
  } else if (format == W_I8 || format == W_I8G) {
    const int8_t* p = (const int8_t*)panel + k * NR;
    *w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void*)p)));
    *w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void*)(p + 8))));
    if (format == W_I8G) *w0 = _mm256_mul_ps(*w0, s0), *w1 = _mm256_mul_ps(*w1, s1);
  } else {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const void*)(panel + k * 8)));
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    *w0 = _mm256_fmadd_ps(q0, s0, m0);
    *w1 = _mm256_fmadd_ps(q1, s1, m1);
  }
}

/* The group of input k0's scales (and minimums) of a grouped panel whose scales start at s (m). */
INLINE void group_scales(int format, const f16* s, const f16* m, int64_t k0, __m256* s0, __m256* s1, __m256* m0,
                         __m256* m1) {
  *s0 = *s1 = *m0 = *m1 = _mm256_setzero_ps();
  if (GROUPED(format)) *s0 = load8_f16(s + k0 / GROUP * NR), *s1 = load8_f16(s + k0 / GROUP * NR + 8);
  if (format == W_I4) *m0 = load8_f16(m + k0 / GROUP * NR), *m1 = load8_f16(m + k0 / GROUP * NR + 8);
}

/* Rows m0 .. m0 + rows - 1 (rows <= MR; a constant where inlined, so the accumulators live in
   registers) times the panel (in `format`; n gives its columns and int4 scales). */
INLINE void tile(const int format, const int rows, const Mat* g, int m0, int n, const char* panel) {
  __m256 acc[MR][2];
  for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* a = g->x + m0 * g->lda;
  const f16 *s = NULL, *m = NULL; /* grouped: this panel's scales, one group's 16 at a time */
  if (GROUPED(format)) s = g->scale + (int64_t)n * (g->K / GROUP) * NR;
  if (format == W_I4) m = g->mins + (int64_t)n * (g->K / GROUP) * NR;
  const int64_t step = GROUPED(format) ? GROUP : g->K; /* a group's scales widened once */
  for (int64_t k0 = 0; k0 < g->K; k0 += step) {
    __m256 s0, s1, m0, m1;
    group_scales(format, s, m, k0, &s0, &s1, &m0, &m1);
    for (int64_t k = k0; k < k0 + step; ++k) {
      __m256 w0, w1;
      load_weights(format, panel, k, s0, s1, m0, m1, &w0, &w1);
#pragma GCC unroll 6
      for (int r = 0; r < rows; ++r) {
        const __m256 av = _mm256_broadcast_ss(a + r * g->lda + k);
        acc[r][0] = _mm256_fmadd_ps(av, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(av, w1, acc[r][1]);
      }
    }
  }
  int col0, col1;
  panel_cols(g, n, &col0, &col1);
  const int64_t out_bytes = g->out_bf16 ? 2 : 4;
  float sums[MR][2][8]; /* out of registers in one unrolled loop, so acc never lives in memory */
#pragma GCC unroll 6
  for (int r = 0; r < rows; ++r) _mm256_storeu_ps(sums[r][0], acc[r][0]), _mm256_storeu_ps(sums[r][1], acc[r][1]);
  for (int r = 0; r < rows; ++r)
    store_row_f32(g, sums[r][0], sums[r][1], col0, col1, (char*)g->out + (m0 + r) * g->ldc * out_bytes);
}

#define TILE_CASE(F, R) \
  case R: tile(F, R, g, m0, n, panel); break;
#define TILE_ROWS(F)                                                                        \
  static void tile_rows_##F(int rows, const Mat* g, int m0, int n, const char* panel) {     \
    switch (rows) { TILE_CASE(F, 1) TILE_CASE(F, 2) TILE_CASE(F, 3) TILE_CASE(F, 4) TILE_CASE(F, 5) TILE_CASE(F, 6) } \
  }
TILE_ROWS(W_F32)
TILE_ROWS(W_BF16)
TILE_ROWS(W_I8)
TILE_ROWS(W_I4)
TILE_ROWS(W_I8G)

static void tile_rows(int format, int rows, const Mat* g, int m0, int n, const char* panel) {
  switch (format) {
    case W_F32: tile_rows_W_F32(rows, g, m0, n, panel); break;
    case W_BF16: tile_rows_W_BF16(rows, g, m0, n, panel); break;
    case W_I8: tile_rows_W_I8(rows, g, m0, n, panel); break;
    case W_I4: tile_rows_W_I4(rows, g, m0, n, panel); break;
    default: tile_rows_W_I8G(rows, g, m0, n, panel); break;
  }
}
#else
/* Portable: one row and one panel at a time, the same sums in the same order. */
static void tile_rows(int format, int rows, const Mat* g, int m0, int n, const char* panel) {
  int col0, col1;
  panel_cols(g, n, &col0, &col1);
  const f16* s = GROUPED(format) ? g->scale + (int64_t)n * (g->K / GROUP) * NR : NULL;
  const f16* mn = format == W_I4 ? g->mins + (int64_t)n * (g->K / GROUP) * NR : NULL;
  const int64_t out_bytes = g->out_bf16 ? 2 : 4;
  for (int r = 0; r < rows; ++r) {
    const float* a = g->x + (m0 + r) * g->lda;
    float acc[NR] = {0};
    for (int64_t k = 0; k < g->K; ++k)
      for (int j = 0; j < NR; ++j) acc[j] += a[k] * weight_at(format, panel, s, mn, k, j);
    store_row_f32(g, acc, acc + 8, col0, col1, (char*)g->out + (m0 + r) * g->ldc * out_bytes);
  }
}
#endif

/* The panel dequantized into buf [K, 16] float32 (W_F32's layout). */
static void dequantize_panel(const Mat* g, int n, float* buf) {
  const char* panel = g->packed + (int64_t)n * panel_bytes(g->format, g->K);
  const int64_t at = (int64_t)n * (g->K / GROUP) * NR;
  const f16* s = GROUPED(g->format) ? g->scale + at : NULL;
  const f16* m = g->format == W_I4 ? g->mins + at : NULL;
  for (int64_t k = 0; k < g->K; ++k)
#ifdef __AVX2__
  {
    __m256 s0, s1, m0, m1, w0, w1;
    group_scales(g->format, s, m, k, &s0, &s1, &m0, &m1);
    load_weights(g->format, panel, k, s0, s1, m0, m1, &w0, &w1);
    _mm256_storeu_ps(buf + k * NR, w0);
    _mm256_storeu_ps(buf + k * NR + 8, w1);
  }
#else
    for (int j = 0; j < NR; ++j) buf[k * NR + j] = weight_at(g->format, panel, s, m, k, j);
#endif
}

static void float_panels(const void* ctx, int t, int nt) {
  const Mat* g = ctx;
  const int panels = g->N / NR;
  const int64_t bytes = panel_bytes(g->format, g->K);
  const int lo = (int)((int64_t)panels * t / nt), hi = (int)((int64_t)panels * (t + 1) / nt);
  float* buf = g->format != W_F32 && g->M > 2 * MR ? malloc(sizeof(float) * g->K * NR) : NULL;
  for (int m_lo = 0; m_lo < g->M; m_lo += MBLOCK) {
    const int m_hi = g->M < m_lo + MBLOCK ? g->M : m_lo + MBLOCK;
    const int copy = buf && m_hi - m_lo > 2 * MR;
    for (int n = lo; n < hi; ++n) {
      const char* panel = g->packed + n * bytes;
      int format = g->format;
      if (copy) dequantize_panel(g, n, buf), panel = (const char*)buf, format = W_F32;
      for (int m0 = m_lo; m0 < m_hi; m0 += MR)
        tile_rows(format, m_hi - m0 < MR ? m_hi - m0 : MR, g, m0, n, panel);
    }
  }
  free(buf);
}

/* out [M, ldc] (float32 or bfloat16) = x W^T (+ bias), or silu(gate) * up with halves and silu;
   x [M, K] float32 or bfloat16 (x_bf16) with a row stride of lda elements; W packed in `format`
   (see the top of this file); scale / mins as the format needs (int8: float32 [N]; grouped:
   float16); bias float32 [N] or NULL. Returns 0, or -1 when out of memory (nothing written). */
int matmul_float(const void* x, int64_t lda, int x_bf16, int format, const void* packed, const void* scale,
                  const void* mins, const float* bias, void* out, int64_t ldc, int out_bf16, int M, int N,
                 int K, int halves, int silu, int threads) {
  float* xf = NULL;
  if (x_bf16) { /* widened once: each row is read by every panel */
    xf = malloc(sizeof(float) * (int64_t)M * K);
    if (!xf) return -1;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t k = 0; k < K; ++k) xf[i * K + k] = bf16_to_f32(((const bf16*)x)[i * lda + k]);
    lda = K;
  }
  const Mat g = {xf ? xf : (const float*)x, lda, (const char*)packed, format, GROUPED(format) ? scale : NULL,
                 mins, format == W_I8 ? (const float*)scale : NULL, bias, out, ldc, out_bf16, M, N, K, halves, silu};
  run_threads(threads, float_panels, &g);
  free(xf);
  return 0;
}

/* ---- W8A8: int8 x int8 in int32, exact ---- */
#ifdef __AVX2__
/* Rows m0.. of xq [M, K] int16 (quantized activations) times panel n of int8 pairs. */
INLINE void tile_w8a8(const int rows, const int16_t* xq, int64_t K, const int8_t* panel, float v[MR][2][8]) {
  __m256i acc[MR][2];
  for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int64_t p = 0; p < K / 2; ++p) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const void*)(panel + p * 32)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const void*)(panel + p * 32 + 16)));
#pragma GCC unroll 6
    for (int r = 0; r < rows; ++r) {
      int32_t pair;
      memcpy(&pair, xq + r * K + 2 * p, 4);
      const __m256i av = _mm256_set1_epi32(pair);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(av, w0));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(av, w1));
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < rows; ++r) {
    _mm256_storeu_ps(v[r][0], _mm256_cvtepi32_ps(acc[r][0]));
    _mm256_storeu_ps(v[r][1], _mm256_cvtepi32_ps(acc[r][1]));
  }
}
#define W8A8_CASE(R) \
  case R: tile_w8a8(R, xq, K, panel, v); break;
static void tile_w8a8_rows(int rows, const int16_t* xq, int64_t K, const int8_t* panel, float v[MR][2][8]) {
  switch (rows) { W8A8_CASE(1) W8A8_CASE(2) W8A8_CASE(3) W8A8_CASE(4) }
}
#endif

typedef struct {
  const Mat* g;
  const void* x;
  int64_t lda;
  int x_bf16;
  int16_t* xq;
  float* xs;
  const float* w_scale;
} W8A8;

/* Thread t's rows quantized, then (once every thread's are) its panels. */
static void w8a8_panels(const void* ctx, int t, int nt) {
  const W8A8* a = ctx;
  const Mat* g = a->g;
  const int M = g->M, N = g->N;
  const int64_t K = g->K;
  int16_t* xq = a->xq;
  float* xs = a->xs;
  for (int64_t i = (int64_t)M * t / nt; i < (int64_t)M * (t + 1) / nt; ++i)
    xs[i] = a->x_bf16 ? quantize_row_bf16((const bf16*)a->x + i * a->lda, K, xq + i * K)
                      : quantize_row_f32((const float*)a->x + i * a->lda, K, xq + i * K);
  if (nt > 1) {
    #pragma omp barrier
  }
  const int panels = N / NR;
  const int64_t out_bytes = g->out_bf16 ? 2 : 4;
  const int8_t* packed = (const int8_t*)g->packed;
  const int lo = (int)((int64_t)panels * t / nt), hi = (int)((int64_t)panels * (t + 1) / nt);
  for (int m_lo = 0; m_lo < M; m_lo += MBLOCK) {
    const int m_hi = M < m_lo + MBLOCK ? M : m_lo + MBLOCK;
    for (int n = lo; n < hi; ++n) {
      const int8_t* panel = packed + (int64_t)n * K * NR;
      int col0, col1;
      panel_cols(g, n, &col0, &col1);
      for (int m0 = m_lo; m0 < m_hi; m0 += MR_W8A8) {
        const int rows = m_hi - m0 < MR_W8A8 ? m_hi - m0 : MR_W8A8;
        float v[MR][2][8];
#ifdef __AVX2__
        tile_w8a8_rows(rows, xq + (int64_t)m0 * K, K, panel, v);
#else
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < NR; ++j) {
            int32_t sum = 0;
            for (int64_t k = 0; k < K; ++k) sum += xq[(m0 + r) * K + k] * panel[(k / 2) * 32 + j * 2 + k % 2];
            v[r][j / 8][j % 8] = (float)sum;
          }
#endif
        for (int r = 0; r < rows; ++r) {
          for (int j = 0; j < 8; ++j) {
            v[r][0][j] *= xs[m0 + r] * a->w_scale[col0 + j];
            v[r][1][j] *= xs[m0 + r] * a->w_scale[col1 + j];
          }
          store_row_f32(g, v[r][0], v[r][1], col0, col1, (char*)g->out + (m0 + r) * g->ldc * out_bytes);
        }
      }
    }
  }
}

/* out = (xq . wq) * x_scale[row] * w_scale[col] (+ bias) for x [M, K] (float32 or bfloat16, row
   stride lda elements) quantized per row here, W packed as W8A8 int8 pairs with w_scale [N]. Returns 0, or
   -1 when out of memory (nothing written). */
int matmul_w8a8(const void* x, int64_t lda, int x_bf16, const int8_t* packed, const float* w_scale,
                const float* bias, void* out, int64_t ldc, int out_bf16, int M, int N, int K, int halves,
                int silu, int threads) {
  int16_t* xq = malloc(sizeof(int16_t) * (int64_t)M * K);
  float* xs = malloc(sizeof(float) * M);
  if (!xq || !xs) {
    free(xq), free(xs);
    return -1;
  }
  const Mat g = {NULL, 0, (const char*)packed, W_F32, NULL, NULL, NULL, bias, out, ldc, out_bf16, M, N, K, halves, silu};
  const W8A8 args = {&g, x, lda, x_bf16, xq, xs, w_scale};
  run_threads(threads, w8a8_panels, &args);
  free(xq);
  free(xs);
  return 0;
}
