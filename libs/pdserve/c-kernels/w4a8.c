/* The W4A8 matmul (see pdserve/layers/cpu_matmul.py, format w4a8 / w8a8_g32): 4-bit weights (or
   int8 as two 4-bit planes) times int8 activations quantized per group of 32 inputs. */
#include "matmul.h"

#include "amx.h"
#include "quantize.h"

#define MBLOCK 48 /* rows per block: a block of activations stays in L2 */

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
   nibble), the operand order of a 4-byte dot per column; scales and mins as matmul.c's W_I4,
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

/* Row i of x (float32 or bfloat16) quantized per group of 32 inputs into xq, xd, xm. With AVX-512 a
   group is two vectors, the same values quantize.h's loops give (max |x|, x * (127 / max |x|)
   rounded half to even: vcvtps2dq in the default rounding mode, as nearbyintf), ~10 times
   faster: a matmul quantizes every row it multiplies, and each of a token's k experts its own
   copy of the token's row. */
static void quantize_groups(const void* x, int64_t lda, int x_bf16, int64_t i, int64_t K, int8_t* xq, float* xd,
                            float* xm) {
  for (int64_t g = 0; g < K / GROUP; ++g) {
    const int64_t at = i * lda + g * GROUP;
    int8_t* q8 = xq + i * K + g * GROUP;
    int sum = 0;
#ifdef __AVX512F__
    const __m512 lo = x_bf16 ? load16_bf16((const bf16*)x + at) : _mm512_loadu_ps((const float*)x + at);
    const __m512 hi = x_bf16 ? load16_bf16((const bf16*)x + at + 16) : _mm512_loadu_ps((const float*)x + at + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inverse = _mm512_set1_ps(quantize_inverse(amax));
    const __m512i q_lo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
    const __m512i q_hi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
    _mm_storeu_si128((__m128i*)q8, _mm512_cvtepi32_epi8(q_lo));
    _mm_storeu_si128((__m128i*)(q8 + 16), _mm512_cvtepi32_epi8(q_hi));
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
    const float d = amax / 127.f;
#else
    int16_t q[GROUP];
    const float d = x_bf16 ? quantize_row_bf16((const bf16*)x + at, GROUP, q)
                           : quantize_row_f32((const float*)x + at, GROUP, q);
    for (int k = 0; k < GROUP; ++k) q8[k] = (int8_t)q[k], sum += q[k];
#endif
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

#ifdef __AMX_TILE__
#define W4A8_AMX_ROWS 16 /* from this many rows on, the AMX path (the same sums: see amx.c) */

/* The AMX path's finished block (panel n, rows m0..m0+15) into out, as the vector path stores it. */
typedef struct {
  const Mat* g;
  int64_t out_bytes;
} W4A8Out;
static void w4a8_emit(void* ctx, int n, int64_t m0, float sums[16][16]) {
  const W4A8Out* o = ctx;
  int col0, col1;
  panel_cols(o->g, n, &col0, &col1);
  for (int r = 0; r < AMX_ROWS && m0 + r < o->g->M; ++r)
    store_row_f32(o->g, sums[r], sums[r] + 8, col0, col1, (char*)o->g->out + (m0 + r) * o->g->ldc * o->out_bytes);
}
#endif

typedef struct {
  const W4A8* w;
  const Mat* g;
  const void* x;
  int64_t lda;
  int x_bf16, planes, amx; /* amx: the AMX path (AMX variant, M >= W4A8_AMX_ROWS) */
  int8_t* xq;              /* w's quantized activations, written here */
  float *xd, *xm;
  int* failed;
} W4A8Run;

/* Thread t's rows quantized, then (once every thread's are) its panels. */
static void w4a8_panels(const void* ctx, int t, int nt) {
  const W4A8Run* a = ctx;
  const W4A8* w = a->w;
  const Mat* g = a->g;
  const int M = g->M;
  for (int64_t i = (int64_t)M * t / nt; i < (int64_t)M * (t + 1) / nt; ++i)
    quantize_groups(a->x, a->lda, a->x_bf16, i, w->K, a->xq, a->xd, a->xm);
  if (nt > 1) {
    #pragma omp barrier
  }
  const int panels = g->N / NR;
  const int64_t out_bytes = g->out_bf16 ? 2 : 4;
  const int lo = (int)((int64_t)panels * t / nt), hi = (int)((int64_t)panels * (t + 1) / nt);
#ifdef __AMX_TILE__
  if (a->amx) {
    W4A8Out emit_ctx = {g, out_bytes};
    if (amx_w4a8_panels(w->xq, w->xd, w->xm, w->K, M, w->packed, a->planes, w->scale, w->mins, lo, hi, w4a8_emit,
                        &emit_ctx)) {
      #pragma omp atomic write
      *a->failed = 1;
    }
    return;
  }
#endif
  for (int m_lo = 0; m_lo < M; m_lo += MBLOCK) {
    const int m_hi = M < m_lo + MBLOCK ? M : m_lo + MBLOCK;
    for (int n = lo; n < hi; ++n) {
      int col0, col1;
      panel_cols(g, n, &col0, &col1);
      for (int m0 = m_lo; m0 < m_hi; m0 += W4A8_ROWS) {
        const int rows = m_hi - m0 < W4A8_ROWS ? m_hi - m0 : W4A8_ROWS;
        float v[W4A8_ROWS][NR];
        tile_w4a8_rows(rows, a->planes, w, m0, n, v);
        for (int r = 0; r < rows; ++r)
          store_row_f32(g, v[r], v[r] + 8, col0, col1, (char*)g->out + (m0 + r) * g->ldc * out_bytes);
      }
    }
  }
}

/* out [M, ldc] (float32 or bfloat16) = x W^T (+ bias), or silu(gate) * up with halves and silu, for
   x [M, K] float32 or bfloat16 (row stride lda elements) and W packed in `planes` 4-bit planes
   (see above). Returns 0, or -1 when out of memory (nothing written). */
int matmul_w4a8(const void* x, int64_t lda, int x_bf16, const uint8_t* packed, int planes, const void* scale,
                const void* mins, const float* bias, void* out, int64_t ldc, int out_bf16, int M, int N, int K,
                int halves, int silu, int threads) {
  int64_t padded = M; /* rows of the quantized activations: the AMX path pads them to whole tiles */
  int amx = 0;
#ifdef __AMX_TILE__
  amx = M >= W4A8_AMX_ROWS;
  if (amx) padded = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
#endif
  int8_t* xq = malloc(padded * K);
  float* xd = malloc(sizeof(float) * padded * (K / GROUP) * 2);
  if (!xq || !xd) {
    free(xq), free(xd);
    return -1;
  }
  float* xm = xd + padded * (K / GROUP);
  memset(xq + (int64_t)M * K, 0, (padded - M) * K);
  memset(xd + (int64_t)M * (K / GROUP), 0, sizeof(float) * (padded - M) * (K / GROUP));
  memset(xm + (int64_t)M * (K / GROUP), 0, sizeof(float) * (padded - M) * (K / GROUP));
  const W4A8 w = {xq, xd, xm, packed, scale, mins, K};
  const Mat g = {NULL, 0, NULL, 0, NULL, NULL, NULL, bias, out, ldc, out_bf16, M, N, K, halves, silu};
  int failed = 0;
  const W4A8Run args = {&w, &g, x, lda, x_bf16, planes, amx, xq, xd, xm, &failed};
  run_threads(threads, w4a8_panels, &args);
  free(xq);
  free(xd);
  return failed ? -1 : 0;
}
