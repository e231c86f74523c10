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
#include "common.h"

#include <omp.h>

#include "quantize.h"

enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2, W_I4 = 3, W_I8G = 4 };
#define GROUPED(format) ((format) == W_I4 || (format) == W_I8G) /* scales per group of inputs */
#define NR 16
#define GROUP 32   /* int4: inputs per scale */
#define MR 6       /* rows per register tile: 6 x 2 accumulators */
#define MBLOCK 48  /* rows per block: a block of activations stays in L2 */
#define MR_W8A8 4  /* W8A8: each product needs a register of its own before the add */

static int64_t panel_bytes(int format, int64_t K) {
  return format == W_F32 ? K * 64 : format == W_BF16 ? K * 32 : format == W_I4 ? K * 8 : K * 16;
}

typedef struct {
  const float* x; /* activations, float32 [M, lda] */
  int64_t lda;
  const char* packed;
  int format;
  const f16 *scale, *mins;   /* W_I4, W_I8G: scale (and W_I4's mins) [N / 16, K / 32, 16] */
  const float* col_scale;    /* W_I8 (also once dequantized into a float32 copy): [N] */
  const float* bias;         /* [N] or NULL */
  void* out;
  int64_t ldc;
  int out_bf16, M, N, K, halves, silu;
} Mat;

/* Output columns of panel n: its first 8 (col0) and last 8 (col1) accumulators. */
INLINE void panel_cols(const Mat* g, int n, int* col0, int* col1) {
  *col0 = g->halves ? n * NR / 2 : n * NR;
  *col1 = g->halves ? g->N / 2 + *col0 : *col0 + NR / 2;
}

/* One row's finished sums v0 (columns col0..col0+7) and v1 (col1..) into out row c. */
INLINE void store_row_f32(const Mat* g, float v0[8], float v1[8], int col0, int col1, char* c) {
  for (int j = 0; j < 8; ++j) {
    if (g->col_scale) v0[j] *= g->col_scale[col0 + j], v1[j] *= g->col_scale[col1 + j];
    if (g->bias) v0[j] += g->bias[col0 + j], v1[j] += g->bias[col1 + j];
  }
  if (g->out_bf16) {
    bf16* o = (bf16*)c;
    if (g->silu) {
#ifdef __AVX2__
      const __m256 gate = bf16_to_f32_8(round8_bf16(_mm256_loadu_ps(v0)));
      const __m256 up = bf16_to_f32_8(round8_bf16(_mm256_loadu_ps(v1)));
      store8_bf16(o + col0, _mm256_mul_ps(bf16_to_f32_8(round8_bf16(silu256(gate))), up));
#else
      for (int j = 0; j < 8; ++j) {
        const float gate = round_bf16(v0[j]), up = round_bf16(v1[j]);
        o[col0 + j] = f32_to_bf16(round_bf16(gate / (1.f + expf(-gate))) * up);
      }
#endif
    } else {
      for (int j = 0; j < 8; ++j) o[col0 + j] = f32_to_bf16(v0[j]), o[col1 + j] = f32_to_bf16(v1[j]);
    }
  } else {
    float* o = (float*)c;
    if (g->silu) {
#ifdef __AVX2__
      _mm256_storeu_ps(o + col0, _mm256_mul_ps(silu256(_mm256_loadu_ps(v0)), _mm256_loadu_ps(v1)));
#else
      for (int j = 0; j < 8; ++j) o[col0 + j] = v0[j] / (1.f + expf(-v0[j])) * v1[j];
#endif
    } else {
      for (int j = 0; j < 8; ++j) o[col0 + j] = v0[j], o[col1 + j] = v1[j];
    }
  }
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
INLINE __m256 load8_f16(const f16* x) { return _mm256_cvtph_ps(_mm_loadu_si128((const void*)x)); }

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

static void run_float(const Mat* g, int threads) {
  const int panels = g->N / NR;
  const int64_t bytes = panel_bytes(g->format, g->K);
  #pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
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
  run_float(&g, threads);
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
  const int panels = N / NR;
  const Mat g = {NULL, 0, (const char*)packed, W_F32, NULL, NULL, NULL, bias, out, ldc, out_bf16, M, N, K, halves, silu};
  const int64_t out_bytes = out_bf16 ? 2 : 4;
  #pragma omp parallel num_threads(threads)
  {
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < M; ++i)
      xs[i] = x_bf16 ? quantize_row_bf16((const bf16*)x + i * lda, K, xq + i * K)
                     : quantize_row_f32((const float*)x + i * lda, K, xq + i * K);
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int lo = (int)((int64_t)panels * t / nt), hi = (int)((int64_t)panels * (t + 1) / nt);
    for (int m_lo = 0; m_lo < M; m_lo += MBLOCK) {
      const int m_hi = M < m_lo + MBLOCK ? M : m_lo + MBLOCK;
      for (int n = lo; n < hi; ++n) {
        const int8_t* panel = packed + (int64_t)n * K * NR;
        int col0, col1;
        panel_cols(&g, n, &col0, &col1);
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
              v[r][0][j] *= xs[m0 + r] * w_scale[col0 + j];
              v[r][1][j] *= xs[m0 + r] * w_scale[col1 + j];
            }
            store_row_f32(&g, v[r][0], v[r][1], col0, col1, (char*)out + (m0 + r) * ldc * out_bytes);
          }
        }
      }
    }
  }
  free(xq);
  free(xs);
  return 0;
}

/* ---- W4A8: 4-bit weights x int8 activations, per group of 32 inputs (llama.cpp's Q4_1 x Q8_1) ----
   Each row of activations is quantized per group g of 32 inputs (symmetric, as quantize.h does a
   row: x ~ q * d[g]); with the weight's w = u * s[g] + m[g],
     out = sum_g (s[g] * d[g] * sum_k u q + m[g] * d[g] * sum_k q),
   the inner sums exact in integers: VNNI vpdpbusd (u8 weights x s8 activations, int32), or AVX2
   vpmaddubsw, whose int16 pair sums cannot saturate on 4-bit weights (|2 * 15 * 127| = 3810, and
   eight of them per group 30480 < 32767) before vpmaddwd widens them. The group terms add in
   float32, in order. u is int4 (planes = 1: Q4_1, u in 0..15) or int8 stored as two 4-bit planes
   (planes = 2: u = q + 128 = low + 16 high for an int8 q, m = -128 s: llama.cpp's Q8_0 x Q8_1),
   whose integer sums are the low plane's plus 16 times the high plane's.
   Packed weight [N / 16, K / 32, planes, 4, 64] bytes: for each group, plane and quarter v of the
   group, byte 4 j + i holds input 8 v + i of column j (low nibble) and input 8 v + 4 + i (high
   nibble), the operand order of a 4-byte dot per column; scales and mins as W_I4's,
   [N / 16, K / 32, 16] float16. */
/* Vectors of LANES columns (AVX-512: all 16 of a panel; AVX2: 8, so a panel takes two passes) and
   rows per tile (each row keeps an integer and a float accumulator per pass). */
#if defined(__AVX512BW__)
#define W4A8_ROWS 8
#define LANES 16
typedef __m512i vint;
typedef __m512 vfloat;
#define V_LOAD(p) _mm512_loadu_si512((const void*)(p))
#define V_AND _mm512_and_si512
#define V_SRLI16 _mm512_srli_epi16
#define V_SET1_8 _mm512_set1_epi8
#define V_SET1_32 _mm512_set1_epi32
#define V_SLLI32 _mm512_slli_epi32
#define V_ADD32 _mm512_add_epi32
#define V_ZERO_I _mm512_setzero_si512
#define V_ZERO_F _mm512_setzero_ps
#define V_CVT _mm512_cvtepi32_ps
#define V_FMA _mm512_fmadd_ps
#define V_MUL _mm512_mul_ps
#define V_SET1_PS _mm512_set1_ps
#define V_LOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const void*)(p)))
#define V_STORE _mm512_storeu_ps
#ifdef __AVX512VNNI__
#define V_DOT4(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define V_FINISH(acc) (acc)
#else
#define V_DOT4(acc, w, x) _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x))
#define V_FINISH(acc) _mm512_madd_epi16(acc, _mm512_set1_epi16(1))
#endif
#elif defined(__AVX2__)
#define W4A8_ROWS 4
#define LANES 8
typedef __m256i vint;
typedef __m256 vfloat;
#define V_LOAD(p) _mm256_loadu_si256((const void*)(p))
#define V_AND _mm256_and_si256
#define V_SRLI16 _mm256_srli_epi16
#define V_SET1_8 _mm256_set1_epi8
#define V_SET1_32 _mm256_set1_epi32
#define V_SLLI32 _mm256_slli_epi32
#define V_ADD32 _mm256_add_epi32
#define V_ZERO_I _mm256_setzero_si256
#define V_ZERO_F _mm256_setzero_ps
#define V_CVT _mm256_cvtepi32_ps
#define V_FMA _mm256_fmadd_ps
#define V_MUL _mm256_mul_ps
#define V_SET1_PS _mm256_set1_ps
#define V_LOAD_F16 load8_f16
#define V_STORE _mm256_storeu_ps
#define V_DOT4(acc, w, x) _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)) /* int16 sums, widened once */
#define V_FINISH(acc) _mm256_madd_epi16(acc, _mm256_set1_epi16(1))               /* a group and plane */
#else
#define W4A8_ROWS 4
#endif

typedef struct {
  const int8_t* xq;     /* activations quantized per group, [M, K] */
  const float *xd, *xm; /* [M, K / 32]: d[g] and d[g] * sum_k q */
  const uint8_t* packed;
  const f16 *scale, *mins;
  int64_t K;
} W4A8;

/* Row i of x (float32 or bfloat16) quantized per group of 32 inputs into xq, xd, xm. */
static void quantize_groups(const void* x, int64_t lda, int x_bf16, int64_t i, int64_t K, int8_t* xq, float* xd,
                            float* xm) {
  int16_t q[GROUP];
  for (int64_t g = 0; g < K / GROUP; ++g) {
    const int64_t at = i * lda + g * GROUP;
    const float d = x_bf16 ? quantize_row_bf16((const bf16*)x + at, GROUP, q)
                           : quantize_row_f32((const float*)x + at, GROUP, q);
    int sum = 0;
    for (int k = 0; k < GROUP; ++k) xq[i * K + g * GROUP + k] = (int8_t)q[k], sum += q[k];
    xd[i * (K / GROUP) + g] = d, xm[i * (K / GROUP) + g] = d * (float)sum;
  }
}

#if defined(__AVX2__)
/* Rows m0 .. m0 + rows - 1 times panel n: v[r] the sums of the panel's 16 columns. */
INLINE void tile_w4a8(const int rows, const int planes, const W4A8* g, int m0, int n, float v[W4A8_ROWS][NR]) {
  const int64_t groups = g->K / GROUP;
  const uint8_t* panel = g->packed + (int64_t)n * groups * planes * 256;
  const f16 *s = g->scale + (int64_t)n * groups * NR, *mn = g->mins + (int64_t)n * groups * NR;
  const vint low = V_SET1_8(15);
  for (int h = 0; h < NR / LANES; ++h) { /* columns LANES h .. : bytes 4 LANES h .. of each 64 */
    vfloat acc[W4A8_ROWS];
    for (int r = 0; r < rows; ++r) acc[r] = V_ZERO_F();
    for (int64_t q = 0; q < groups; ++q) {
      vint isum[W4A8_ROWS];
      const int8_t* x = g->xq + m0 * g->K + q * GROUP;
      for (int plane = 0; plane < planes; ++plane) {
        vint part[W4A8_ROWS];
        for (int r = 0; r < rows; ++r) part[r] = V_ZERO_I();
        const uint8_t* p = panel + (q * planes + plane) * 256 + h * LANES * 4;
#pragma GCC unroll 1 /* unrolled, GCC sums all 32 int16 products of a group as a tree: AVX2 spills */
        for (int quarter = 0; quarter < 4; ++quarter) {
          const vint b = V_LOAD(p + quarter * 64);
          const vint lo = V_AND(b, low), hi = V_AND(V_SRLI16(b, 4), low);
#pragma GCC unroll 8
          for (int r = 0; r < rows; ++r) {
            int32_t x_lo, x_hi;
            memcpy(&x_lo, x + r * g->K + 8 * quarter, 4);
            memcpy(&x_hi, x + r * g->K + 8 * quarter + 4, 4);
            part[r] = V_DOT4(part[r], lo, V_SET1_32(x_lo));
            part[r] = V_DOT4(part[r], hi, V_SET1_32(x_hi));
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < rows; ++r) {
          const vint sum = V_SLLI32(V_FINISH(part[r]), 4 * plane);
          isum[r] = plane ? V_ADD32(isum[r], sum) : sum;
        }
      }
      const vfloat ws = V_LOAD_F16(s + q * NR + h * LANES), wm = V_LOAD_F16(mn + q * NR + h * LANES);
#pragma GCC unroll 8
      for (int r = 0; r < rows; ++r) {
        const int64_t at = (m0 + r) * groups + q;
        acc[r] = V_FMA(V_CVT(isum[r]), V_MUL(ws, V_SET1_PS(g->xd[at])), acc[r]);
        acc[r] = V_FMA(wm, V_SET1_PS(g->xm[at]), acc[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) V_STORE(v[r] + h * LANES, acc[r]);
  }
}
#define W4A8_CASE(R)                               \
  case R:                                          \
    if (planes == 1) tile_w4a8(R, 1, g, m0, n, v); \
    else tile_w4a8(R, 2, g, m0, n, v);             \
    break;
static void tile_w4a8_rows(int rows, int planes, const W4A8* g, int m0, int n, float v[W4A8_ROWS][NR]) {
  switch (rows) {
    W4A8_CASE(1) W4A8_CASE(2) W4A8_CASE(3) W4A8_CASE(4)
#if W4A8_ROWS == 8
    W4A8_CASE(5) W4A8_CASE(6) W4A8_CASE(7) W4A8_CASE(8)
#endif
  }
}
#else
/* Portable: the same integer sums and the same float32 steps, one column at a time. */
static void tile_w4a8_rows(int rows, int planes, const W4A8* g, int m0, int n, float v[W4A8_ROWS][NR]) {
  const int64_t groups = g->K / GROUP;
  const uint8_t* panel = g->packed + (int64_t)n * groups * planes * 256;
  const f16 *s = g->scale + (int64_t)n * groups * NR, *mn = g->mins + (int64_t)n * groups * NR;
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < NR; ++j) {
      float acc = 0.f;
      for (int64_t q = 0; q < groups; ++q) {
        const int64_t at = (m0 + r) * groups + q;
        int32_t sum = 0;
        for (int plane = 0; plane < planes; ++plane)
          for (int k = 0; k < GROUP; ++k) {
            const uint8_t byte = panel[(q * planes + plane) * 256 + k / 8 * 64 + j * 4 + k % 4];
            sum += (k % 8 < 4 ? byte & 15 : byte >> 4) * g->xq[(m0 + r) * g->K + q * GROUP + k] * (1 << 4 * plane);
          }
        acc += (float)sum * (f16_to_f32(s[q * NR + j]) * g->xd[at]);
        acc += f16_to_f32(mn[q * NR + j]) * g->xm[at];
      }
      v[r][j] = acc;
    }
}
#endif

/* out [M, ldc] (float32 or bfloat16) = x W^T (+ bias), or silu(gate) * up with halves and silu, for
   x [M, K] float32 or bfloat16 (row stride lda elements) and W packed in `planes` 4-bit planes
   (see above). Returns 0, or -1 when out of memory (nothing written). */
int matmul_w4a8(const void* x, int64_t lda, int x_bf16, const uint8_t* packed, int planes, const void* scale,
                const void* mins, const float* bias, void* out, int64_t ldc, int out_bf16, int M, int N, int K,
                int halves, int silu, int threads) {
  int8_t* xq = malloc((int64_t)M * K);
  float* xd = malloc(sizeof(float) * (int64_t)M * (K / GROUP) * 2);
  if (!xq || !xd) {
    free(xq), free(xd);
    return -1;
  }
  float* xm = xd + (int64_t)M * (K / GROUP);
  const W4A8 w = {xq, xd, xm, packed, scale, mins, K};
  const Mat g = {NULL, 0, NULL, W_I4, NULL, NULL, NULL, bias, out, ldc, out_bf16, M, N, K, halves, silu};
  const int panels = N / NR;
  const int64_t out_bytes = out_bf16 ? 2 : 4;
  #pragma omp parallel num_threads(threads)
  {
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < M; ++i) quantize_groups(x, lda, x_bf16, i, K, xq, xd, xm);
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int lo = (int)((int64_t)panels * t / nt), hi = (int)((int64_t)panels * (t + 1) / nt);
    for (int m_lo = 0; m_lo < M; m_lo += MBLOCK) {
      const int m_hi = M < m_lo + MBLOCK ? M : m_lo + MBLOCK;
      for (int n = lo; n < hi; ++n) {
        int col0, col1;
        panel_cols(&g, n, &col0, &col1);
        for (int m0 = m_lo; m0 < m_hi; m0 += W4A8_ROWS) {
          const int rows = m_hi - m0 < W4A8_ROWS ? m_hi - m0 : W4A8_ROWS;
          float v[W4A8_ROWS][NR];
          tile_w4a8_rows(rows, planes, &w, m0, n, v);
          for (int r = 0; r < rows; ++r)
            store_row_f32(&g, v[r], v[r] + 8, col0, col1, (char*)out + (m0 + r) * ldc * out_bytes);
        }
      }
    }
  }
  free(xq);
  free(xd);
  return 0;
}
