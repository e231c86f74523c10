/* Paged decode attention (see pdserve/layers/attention/cpu_decode_kernel.py). */
#include "attention.h"

/* The steps on one block for one KV head. q: its G query heads, [G, D] in the input dtype; the K
   (V) row of key t < n <= BLOCK is the D elements at byte offset rows[t] of k (v); s, p: [G, BLOCK]
   floats; acc: [G, D] floats. Along the way each step prefetches the next block's K (V) rows, at
   offsets ahead[i] for i < n_ahead, one per row it computes: a steady stream keeps memory busy. */
/* s[g][t] = scale * q_g . k_t, MASKED from t = n */
typedef void ScoresFn(const void* q, const char* k, const int64_t* rows, int n, int64_t group,
                      int64_t head_dim, float scale, float* s, const int64_t* ahead, int n_ahead);
/* acc[g] += sum_t p[g][t] * v_t */
typedef void ValuesFn(const float* p, const char* v, const int64_t* rows, int n, int64_t group,
                      int64_t head_dim, float* acc, const int64_t* ahead, int n_ahead);

INLINE void prefetch_row(const char* row, int64_t bytes) {  /* into L2 */
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(row + line, 0, 2);
}

/* Portable C: the loops over head_dim vectorise under -O3 -ffast-math. */
#define DEFINE_PORTABLE(NAME, T, LOAD)                                                             \
static void NAME##_scores(const void* q, const char* k, const int64_t* rows, int n, int64_t group, \
                          int64_t head_dim, float scale, float* s, const int64_t* ahead, int n_ahead) { \
  for (int64_t g = 0; g < group; ++g) {                                                            \
    const T* qg = (const T*)q + g * head_dim;                                                      \
    for (int t = 0; t < BLOCK; ++t) {                                                              \
      if (g == 0 && t < n_ahead) prefetch_row(k + ahead[t], head_dim * (int64_t)sizeof(T));        \
      if (t >= n) {                                                                                \
        s[g * BLOCK + t] = MASKED;                                                                 \
        continue;                                                                                  \
      }                                                                                            \
      const T* kt = (const T*)(k + rows[t]);                                                       \
      float dot = 0.f;                                                                             \
      _Pragma("omp simd reduction(+ : dot)")                                                       \
      for (int64_t d = 0; d < head_dim; ++d) dot += LOAD(qg[d]) * LOAD(kt[d]);                     \
      s[g * BLOCK + t] = scale * dot;                                                              \
    }                                                                                              \
  }                                                                                                \
}                                                                                                  \
static void NAME##_values(const float* p, const char* v, const int64_t* rows, int n, int64_t group,\
                          int64_t head_dim, float* acc, const int64_t* ahead, int n_ahead) {       \
  for (int64_t g = 0; g < group; ++g)                                                              \
    for (int t = 0; t < n; ++t) {                                                                  \
      if (g == 0 && t < n_ahead) prefetch_row(v + ahead[t], head_dim * (int64_t)sizeof(T));        \
      const T* vt = (const T*)(v + rows[t]);                                                       \
      const float pt = p[g * BLOCK + t];                                                           \
      float* ag = acc + g * head_dim;                                                              \
      _Pragma("omp simd")                                                                          \
      for (int64_t d = 0; d < head_dim; ++d) ag[d] += pt * LOAD(vt[d]);                            \
    }                                                                                              \
}
DEFINE_PORTABLE(portable_f32, float, f32_to_f32)
DEFINE_PORTABLE(portable_bf16, bf16, bf16_to_f32)

#ifdef __AVX512F__
/* The AVX-512 steps work on 64-byte chunks of a row (16 float32 or 32 bfloat16 elements) and on
   tiles of up to MAX_TILE heads of the group, so that each chunk of K or V is loaded once for all
   of a tile's heads. */
#define MAX_TILE 3


/* dot + q . k over a chunk, as 16 lanes of partial sums. */
INLINE __m512 dot_chunk(int is_bf16, __m512 dot, __m512i q, __m512i k) {
  if (!is_bf16) return _mm512_fmadd_ps(_mm512_castsi512_ps(q), _mm512_castsi512_ps(k), dot);
#ifdef __AVX512BF16__
  return _mm512_dpbf16_ps(dot, (__m512bh)q, (__m512bh)k);
#else
  return _mm512_fmadd_ps(bf16_odd(q), bf16_odd(k), _mm512_fmadd_ps(bf16_even(q), bf16_even(k), dot));
#endif
}

/* Lane i of each 128-bit lane L of the result: the sum of 128-bit lane L of v[i] (rows interleaved
   and added in pairs, then in quads). */
INLINE __m512 sum_4_vectors(const __m512 v[4]) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
}

/* Lane t of the result: the total of row t, from sum_4_vectors of rows 0-3, 4-7, 8-11 and 12-15
   (their 128-bit lanes added across vectors). */
INLINE __m512 sum_quads(const __m512 quads[4]) {
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
}

/* Scores of `tile` heads, four keys at a time: a vector of partial sums per (head, key), reduced to
   one vector of 16 scores per head. Keys from n on read key 0's row and are masked. */
INLINE void scores_tile(int is_bf16, int tile, const char* q, const char* k, const int64_t* rows, int n,
                        int64_t head_bytes, float scale, float* s, const int64_t* ahead, int n_ahead) {
  __m512 quads[MAX_TILE][BLOCK / 4];
  for (int r = 0; r < BLOCK / 4; ++r) {
    for (int i = 4 * r; i < 4 * r + 4 && i < n_ahead; ++i) prefetch_row(k + ahead[i], head_bytes);
    const char* keys[4];
    __m512 dots[MAX_TILE][4];
    for (int i = 0; i < 4; ++i) keys[i] = k + rows[4 * r + i < n ? 4 * r + i : 0];
    for (int g = 0; g < tile; ++g)
      for (int i = 0; i < 4; ++i) dots[g][i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < head_bytes; c += 64) {
      __m512i chunks[4];
      for (int i = 0; i < 4; ++i) chunks[i] = load_chunk(keys[i] + c);
      for (int g = 0; g < tile; ++g) {
        const __m512i qc = _mm512_loadu_si512(q + g * head_bytes + c);
        for (int i = 0; i < 4; ++i) dots[g][i] = dot_chunk(is_bf16, dots[g][i], qc, chunks[i]);
      }
    }
    for (int g = 0; g < tile; ++g) quads[g][r] = sum_4_vectors(dots[g]);
  }
  for (int g = 0; g < tile; ++g) {
    const __m512 scores = _mm512_mul_ps(sum_quads(quads[g]), _mm512_set1_ps(scale));
    _mm512_storeu_ps(s + g * BLOCK,
                     _mm512_mask_blend_ps((__mmask16)((1u << n) - 1), _mm512_set1_ps(MASKED), scores));
  }
}

/* One head's D accumulators into / out of D / 16 registers; for bfloat16 each 32 are split into
   (even, odd) elements, the order bf16_even / bf16_odd give V in. */
INLINE void load_acc(int is_bf16, const float* acc, int64_t head_dim, __m512* sums) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  for (int64_t c = 0; c < head_dim / 16; c += 1 + is_bf16) {
    const __m512 lo = _mm512_loadu_ps(acc + 16 * c);
    if (is_bf16) {
      const __m512 hi = _mm512_loadu_ps(acc + 16 * c + 16);
      sums[c] = _mm512_permutex2var_ps(lo, even, hi);
      sums[c + 1] = _mm512_permutex2var_ps(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
    } else {
      sums[c] = lo;
    }
  }
}
INLINE void store_acc(int is_bf16, const __m512* sums, int64_t head_dim, float* acc) {
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  for (int64_t c = 0; c < head_dim / 16; c += 1 + is_bf16) {
    if (is_bf16) {
      const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
      _mm512_storeu_ps(acc + 16 * c, _mm512_permutex2var_ps(sums[c], first, sums[c + 1]));
      _mm512_storeu_ps(acc + 16 * c + 16, _mm512_permutex2var_ps(sums[c], second, sums[c + 1]));
    } else {
      _mm512_storeu_ps(acc + 16 * c, sums[c]);
    }
  }
}

/* acc[g] += sum_t p[g][t] * v_t for `tile` heads, their accumulators in registers over the block. */
INLINE void values_tile(int is_bf16, int tile, const float* p, const char* v, const int64_t* rows, int n,
                        int64_t head_dim, float* acc, const int64_t* ahead, int n_ahead) {
  __m512 sums[MAX_TILE][MAX_CHUNKS];
  for (int g = 0; g < tile; ++g) load_acc(is_bf16, acc + g * head_dim, head_dim, sums[g]);
  for (int t = 0; t < n; ++t) {
    if (t < n_ahead) prefetch_row(v + ahead[t], head_dim * (is_bf16 ? 2 : 4));
    __m512 pt[MAX_TILE];
    for (int g = 0; g < tile; ++g) pt[g] = _mm512_set1_ps(p[g * BLOCK + t]);
    for (int64_t c = 0; c < head_dim / 16; c += 1 + is_bf16) {
      const __m512i x = load_chunk(v + rows[t] + c * 64 / (1 + is_bf16));
      for (int g = 0; g < tile; ++g) {
        if (is_bf16) {
          sums[g][c] = _mm512_fmadd_ps(pt[g], bf16_even(x), sums[g][c]);
          sums[g][c + 1] = _mm512_fmadd_ps(pt[g], bf16_odd(x), sums[g][c + 1]);
        } else {
          sums[g][c] = _mm512_fmadd_ps(pt[g], _mm512_castsi512_ps(x), sums[g][c]);
        }
      }
    }
  }
  for (int g = 0; g < tile; ++g) store_acc(is_bf16, sums[g], head_dim, acc + g * head_dim);
}

/* The group's heads in tiles (a literal tile size each, so that the loops over it unroll); the first
   tile prefetches. */
INLINE void avx512_scores(int is_bf16, int64_t head_dim, const void* q, const char* k, const int64_t* rows,
                          int n, int64_t group, float scale, float* s, const int64_t* ahead, int n_ahead) {
  const int64_t head_bytes = head_dim * (is_bf16 ? 2 : 4);
  for (int64_t g = 0; g < group; g += MAX_TILE) {
    const char* qg = (const char*)q + g * head_bytes;
    float* sg = s + g * BLOCK;
    const int na = g ? 0 : n_ahead;
    if (group - g >= 3) scores_tile(is_bf16, 3, qg, k, rows, n, head_bytes, scale, sg, ahead, na);
    else if (group - g == 2) scores_tile(is_bf16, 2, qg, k, rows, n, head_bytes, scale, sg, ahead, na);
    else scores_tile(is_bf16, 1, qg, k, rows, n, head_bytes, scale, sg, ahead, na);
  }
}
INLINE void avx512_values(int is_bf16, int64_t head_dim, const float* p, const char* v, const int64_t* rows,
                          int n, int64_t group, float* acc, const int64_t* ahead, int n_ahead) {
  const int most = head_dim <= 128 ? MAX_TILE : 1;  /* head_dim 256: 16 accumulator registers a head */
  for (int64_t g = 0, tile; g < group; g += tile) {
    tile = group - g < most ? group - g : most;
    const float* pg = p + g * BLOCK;
    float* ag = acc + g * head_dim;
    const int na = g ? 0 : n_ahead;
    if (tile == 3) values_tile(is_bf16, 3, pg, v, rows, n, head_dim, ag, ahead, na);
    else if (tile == 2) values_tile(is_bf16, 2, pg, v, rows, n, head_dim, ag, ahead, na);
    else values_tile(is_bf16, 1, pg, v, rows, n, head_dim, ag, ahead, na);
  }
}

/* The steps for one dtype and a constant head_dim, so that the loops over it unroll into registers. */
#define DEFINE_AVX512_STEPS(NAME, IS_BF16, D)                                                      \
static void NAME##_scores(const void* q, const char* k, const int64_t* rows, int n, int64_t group, \
                          int64_t head_dim, float scale, float* s, const int64_t* ahead, int n_ahead) { \
  (void)head_dim;                                                                                  \
  avx512_scores(IS_BF16, D, q, k, rows, n, group, scale, s, ahead, n_ahead);                       \
}                                                                                                  \
static void NAME##_values(const float* p, const char* v, const int64_t* rows, int n, int64_t group,\
                          int64_t head_dim, float* acc, const int64_t* ahead, int n_ahead) {       \
  (void)head_dim;                                                                                  \
  avx512_values(IS_BF16, D, p, v, rows, n, group, acc, ahead, n_ahead);                            \
}
DEFINE_AVX512_STEPS(avx512_f32_64, 0, 64)
DEFINE_AVX512_STEPS(avx512_f32_128, 0, 128)
DEFINE_AVX512_STEPS(avx512_f32_256, 0, 256)
DEFINE_AVX512_STEPS(avx512_bf16_64, 1, 64)
DEFINE_AVX512_STEPS(avx512_bf16_128, 1, 128)
DEFINE_AVX512_STEPS(avx512_bf16_256, 1, 256)
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* The AVX2 steps: 8-lane chunks of a row (float32, or bfloat16 widened), four keys' dot products
   at a time reduced by a horizontal-add tree; the accumulators of a head in slabs of 64 elements
   (eight registers) over the block's keys. */
INLINE __m256 load8_row(int is_bf16, const char* row, int64_t i) {
  return is_bf16 ? load8_bf16((const bf16*)row + i) : _mm256_loadu_ps((const float*)row + i);
}

/* Lane i < 4 of the result: the total of the 8 lanes of the i-th argument. */
INLINE __m128 sum_4_vectors(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

INLINE void avx2_scores(int is_bf16, int64_t D, const void* q, const char* k, const int64_t* rows, int n,
                        int64_t group, float scale, float* s, const int64_t* ahead, int n_ahead) {
  const int64_t row_bytes = D * (is_bf16 ? 2 : 4);
  for (int i = 0; i < n_ahead; ++i) prefetch_row(k + ahead[i], row_bytes);
  for (int64_t g = 0; g < group; ++g) {
    const char* qg = (const char*)q + g * row_bytes;
    for (int t0 = 0; t0 < BLOCK; t0 += 4) {
      const char* kr[4];
      for (int i = 0; i < 4; ++i) kr[i] = k + rows[t0 + i < n ? t0 + i : 0];
      __m256 d0 = _mm256_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
      if (t0 < n)
        for (int64_t c = 0; c < D; c += 8) {
          const __m256 qc = load8_row(is_bf16, qg, c);
          d0 = _mm256_fmadd_ps(qc, load8_row(is_bf16, kr[0], c), d0);
          d1 = _mm256_fmadd_ps(qc, load8_row(is_bf16, kr[1], c), d1);
          d2 = _mm256_fmadd_ps(qc, load8_row(is_bf16, kr[2], c), d2);
          d3 = _mm256_fmadd_ps(qc, load8_row(is_bf16, kr[3], c), d3);
        }
      _mm_storeu_ps(s + g * BLOCK + t0, _mm_mul_ps(sum_4_vectors(d0, d1, d2, d3), _mm_set1_ps(scale)));
      for (int i = 0; i < 4; ++i)
        if (t0 + i >= n) s[g * BLOCK + t0 + i] = MASKED;
    }
  }
}

INLINE void avx2_values(int is_bf16, int64_t D, const float* p, const char* v, const int64_t* rows, int n,
                        int64_t group, float* acc, const int64_t* ahead, int n_ahead) {
  for (int i = 0; i < n_ahead; ++i) prefetch_row(v + ahead[i], D * (is_bf16 ? 2 : 4));
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
      float* a = acc + g * D + c0;
      __m256 sums[8];
      for (int j = 0; j < 8; ++j) sums[j] = _mm256_loadu_ps(a + 8 * j);
      for (int t = 0; t < n; ++t) {
        const __m256 pt = _mm256_set1_ps(p[g * BLOCK + t]);
        const char* row = v + rows[t];
        for (int j = 0; j < 8; ++j) sums[j] = _mm256_fmadd_ps(pt, load8_row(is_bf16, row, c0 + 8 * j), sums[j]);
      }
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(a + 8 * j, sums[j]);
    }
}

#define DEFINE_AVX2_STEPS(NAME, IS_BF16, D)                                                        \
static void NAME##_scores(const void* q, const char* k, const int64_t* rows, int n, int64_t group, \
                          int64_t head_dim, float scale, float* s, const int64_t* ahead, int n_ahead) { \
  (void)head_dim;                                                                                  \
  avx2_scores(IS_BF16, D, q, k, rows, n, group, scale, s, ahead, n_ahead);                         \
}                                                                                                  \
static void NAME##_values(const float* p, const char* v, const int64_t* rows, int n, int64_t group,\
                          int64_t head_dim, float* acc, const int64_t* ahead, int n_ahead) {       \
  (void)head_dim;                                                                                  \
  avx2_values(IS_BF16, D, p, v, rows, n, group, acc, ahead, n_ahead);                              \
}
DEFINE_AVX2_STEPS(avx2_f32_64, 0, 64)
DEFINE_AVX2_STEPS(avx2_f32_128, 0, 128)
DEFINE_AVX2_STEPS(avx2_f32_256, 0, 256)
DEFINE_AVX2_STEPS(avx2_bf16_64, 1, 64)
DEFINE_AVX2_STEPS(avx2_bf16_128, 1, 128)
DEFINE_AVX2_STEPS(avx2_bf16_256, 1, 256)
#endif

typedef struct { ScoresFn* scores; ValuesFn* values; } Steps;

static Steps pick_steps(int dtype, int64_t head_dim) {
  (void)head_dim;
#ifdef __AVX512F__
#define AVX512_CASE(D)                                                                             \
  if (head_dim == D)                                                                               \
    return dtype == F32 ? (Steps){avx512_f32_##D##_scores, avx512_f32_##D##_values}                \
                        : (Steps){avx512_bf16_##D##_scores, avx512_bf16_##D##_values};
  AVX512_CASE(64)
  AVX512_CASE(128)
  AVX512_CASE(256)
#elif defined(__AVX2__)
#define AVX2_CASE(D)                                                                               \
  if (head_dim == D)                                                                               \
    return dtype == F32 ? (Steps){avx2_f32_##D##_scores, avx2_f32_##D##_values}                    \
                        : (Steps){avx2_bf16_##D##_scores, avx2_bf16_##D##_values};
  AVX2_CASE(64)
  AVX2_CASE(128)
  AVX2_CASE(256)
#endif
  return dtype == F32 ? (Steps){portable_f32_scores, portable_f32_values}
                      : (Steps){portable_bf16_scores, portable_bf16_values};
}

typedef struct {
  Steps steps;
  const char *q, *k, *v;
  void* out;
  const int64_t *page_table, *row_req, *seq_lens;
  int64_t q_stride, max_pages, page_size, page_stride, num_heads, num_kv_heads, head_dim, group, elem_size;
  float scale, cap; /* cap: soft-capping of the scores, 0 for none */
  const float* sinks; /* [num_heads] sink logits, or NULL */
  int dtype;
} Problem;

/* Soft-capping of a block's scores s [G, BLOCK] (the first n of each head's): cap * tanh(s / cap)
   (Gemma 2's attn_logit_softcapping); the lanes past n stay MASKED. */
static void soft_cap(float* s, int64_t group, int n, float cap) {
  for (int64_t g = 0; g < group; ++g)
    for (int t = 0; t < n; ++t) s[g * BLOCK + t] = cap * tanhf(s[g * BLOCK + t] / cap);
}

/* Online softmax over one block's scores s [G, BLOCK] (overwritten with the probabilities p) for the
   running max m [G], sums l [G, BLOCK] (per lane) and accumulator acc [G, D]. */
static void softmax_step(float* s, int64_t group, int64_t head_dim, float* m, float* l, float* acc) {
  for (int64_t g = 0; g < group; ++g) {
    float *sg = s + g * BLOCK, *lg = l + g * BLOCK, mx = m[g];
    int grows = 0;
    #pragma omp simd reduction(| : grows)
    for (int t = 0; t < BLOCK; ++t) grows |= sg[t] > mx;
    if (grows) {
      #pragma omp simd reduction(max : mx)
      for (int t = 0; t < BLOCK; ++t) mx = fmaxf(mx, sg[t]);
      const float correction = exp_nonpositive(m[g] - mx);
      #pragma omp simd
      for (int t = 0; t < BLOCK; ++t) lg[t] *= correction;
      #pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] *= correction;
      m[g] = mx;
    }
    #pragma omp simd
    for (int t = 0; t < BLOCK; ++t) {
      sg[t] = exp_nonpositive(sg[t] - mx);
      lg[t] += sg[t];
    }
  }
}

/* rows[t] = byte offset in the K and V pools of the token at position first + t, t < n. */
static void token_rows(const Problem* P, const int64_t* pages, int64_t first, int64_t n, int64_t* rows) {
  const int64_t ps = P->page_size, token_bytes = P->num_kv_heads * P->head_dim * P->elem_size;
  const int64_t page_bytes = P->page_stride * P->elem_size;
  for (int64_t t = 0, page = first / ps, offset = first % ps; t < n; ++t) {
    rows[t] = pages[page] * page_bytes + offset * token_bytes;
    if (++offset == ps) offset = 0, ++page;
  }
}

/* Attention of row b's query heads of KV head hk over positions [begin, end) of its request,
   unnormalised, into part = acc [Hq, D], m [Hq], l [Hq] (those heads' entries). scratch: (G + Hq) *
   BLOCK floats. */
static void attend(const Problem* P, int64_t b, int64_t begin, int64_t end, int64_t hk, float* part,
                   float* scratch) {
  const int64_t group = P->group, head_dim = P->head_dim, num_heads = P->num_heads, h = hk * group;
  const int64_t head_bytes = head_dim * P->elem_size;
  float *acc = part + h * head_dim, *m = part + num_heads * head_dim + h, *l = m + num_heads;
  float *s = scratch, *lanes = s + group * BLOCK; /* lanes: per-lane sums, [G, BLOCK] */
  for (int64_t g = 0; g < group; ++g) m[g] = -FLT_MAX;
  memset(acc, 0, sizeof(float) * group * head_dim);
  memset(lanes, 0, sizeof(float) * group * BLOCK);
  const int64_t* pages = P->page_table + (P->row_req ? P->row_req[b] : b) * P->max_pages;
  const char* q = P->q + b * P->q_stride * P->elem_size + h * head_bytes;
  const char *k = P->k + hk * head_bytes, *v = P->v + hk * head_bytes;
  int64_t rows[BLOCK], ahead[BLOCK];
  for (int64_t pos = begin; pos < end; pos += BLOCK) {
    const int n = end - pos < BLOCK ? (int)(end - pos) : BLOCK;
    const int n_ahead = end - pos - n < BLOCK ? (int)(end - pos - n) : BLOCK;
    token_rows(P, pages, pos, n, rows);
    token_rows(P, pages, pos + n, n_ahead, ahead);
    P->steps.scores(q, k, rows, n, group, head_dim, P->scale, s, ahead, n_ahead);
    if (P->cap) soft_cap(s, group, n, P->cap);
    softmax_step(s, group, head_dim, m, lanes, acc);
    P->steps.values(s, v, rows, n, group, head_dim, acc, ahead, n_ahead);
  }
  for (int64_t g = 0; g < group; ++g) {
    l[g] = 0.f;
    for (int t = 0; t < BLOCK; ++t) l[g] += lanes[g * BLOCK + t];
  }
}

/* Merge row b's splits (their parts, in order) and write its output rows; a head's sink logit, if
   any, joins the softmax's max and sum and adds no value. scratch: D floats. */
static void merge(const Problem* P, const float* parts, int64_t splits, int64_t b, float* scratch) {
  const int64_t num_heads = P->num_heads, head_dim = P->head_dim, part_size = num_heads * (head_dim + 2);
  for (int64_t h = 0; h < num_heads; ++h) {
    float mx = -FLT_MAX, l = 0.f;
    for (int64_t i = 0; i < splits; ++i) mx = fmaxf(mx, parts[i * part_size + num_heads * head_dim + h]);
    if (P->sinks) mx = fmaxf(mx, P->sinks[h]);
    memset(scratch, 0, sizeof(float) * head_dim);
    for (int64_t i = 0; i < splits; ++i) {
      const float* part = parts + i * part_size;
      const float w = exp_nonpositive(part[num_heads * head_dim + h] - mx);
      l += w * part[num_heads * (head_dim + 1) + h];
      for (int64_t d = 0; d < head_dim; ++d) scratch[d] += w * part[h * head_dim + d];
    }
    if (P->sinks) l += exp_nonpositive(P->sinks[h] - mx);
    const int64_t out = (b * num_heads + h) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {
      if (P->dtype == F32) ((float*)P->out)[out + d] = scratch[d] / l;
      else ((bf16*)P->out)[out + d] = f32_to_bf16(scratch[d] / l);
    }
  }
}

/* The first key a row of seq_len keys attends: the last `window` of them (a sliding-window layer),
   all (0) with window 0. */
static int64_t window_start(int64_t seq_len, int64_t window) {
  return window && seq_len > window ? seq_len - window : 0;
}

/* q: [rows, num_heads * head_dim] with a row stride of q_stride elements, one query each; out: [rows,
   num_heads, head_dim]; k, v: [num_pages, page_size, num_kv_heads, head_dim], pages page_stride
   elements apart (each page's rows contiguous); page_table: [requests, max_pages]; row_req: [rows],
   the request (page_table row) of each row, or NULL for row i = request i; seq_lens: [rows], each >=
   1: row i attends to keys [0, seq_lens[i]) of its request (a decoding token: its position + 1; a
   token of an extend the same, so a prefill, a chunk or a decode step all compute a token alike);
   window: the keys a row attends, its last ones (a sliding-window layer: the token at position p
   sees keys (p - window, p]), 0 for all; cap: the scores' soft-capping, cap * tanh(s / cap) (0: none);
   sinks: [num_heads] float32 attention-sink logits (gpt-oss), or NULL. dtype: F32 or BF16.

   Every row runs the same steps in the same order, whatever the other rows: its keys in splits of
   SPLIT_KEYS from its first key, each split and KV head a work item (so even one row's work is
   shared by the threads), blocks of BLOCK keys from each split's start, the splits' parts merged in order. The result of a
   row depends on its query and keys alone (not on the batch, its place in it, the thread count or
   how its request's prompt was chunked). Returns 0, or -1 when out of memory (out then
   incomplete). */
int decode_attention(int dtype, const void* q, int64_t q_stride, const void* k, const void* v, void* out,
                     const int64_t* page_table, const int64_t* row_req, const int64_t* seq_lens, int64_t rows,
                     int64_t max_pages, int64_t page_size, int64_t page_stride, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t window, float scale, float cap,
                     const float* sinks, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const Problem P = {pick_steps(dtype, head_dim), q, k, v, out, page_table, row_req, seq_lens, q_stride,
                     max_pages, page_size, page_stride, num_heads, num_kv_heads, head_dim, group,
                     dtype == F32 ? 4 : 2, scale, cap, sinks, dtype};
  /* first[b]: row b's first work item (one per split); first[rows]: all of them */
  int64_t* first = malloc(sizeof(int64_t) * (rows + 1));
  if (!first) return -1;
  first[0] = 0;
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t keys = seq_lens[b] - window_start(seq_lens[b], window);
    first[b + 1] = first[b] + (keys + SPLIT_KEYS - 1) / SPLIT_KEYS;
  }
  const int64_t items = first[rows], part_size = num_heads * (head_dim + 2);
  float* parts = malloc(sizeof(float) * (items ? items : 1) * part_size);
  int64_t* item_row = malloc(sizeof(int64_t) * (items ? items : 1));
  if (!parts || !item_row) {
    free(first), free(parts), free(item_row);
    return -1;
  }
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t i = first[b]; i < first[b + 1]; ++i) item_row[i] = b;
  int failed = 0;
  #pragma omp parallel num_threads(num_threads)
  {
    float* scratch = malloc(sizeof(float) * (2 * group * BLOCK + head_dim));
    if (!scratch) {
      #pragma omp atomic write
      failed = 1;
    }
    #pragma omp for schedule(dynamic)
    for (int64_t work = 0; work < items * num_kv_heads; ++work) { /* (split, KV head) */
      if (!scratch) continue; /* every thread still takes part in the worksharing loops */
      const int64_t item = work / num_kv_heads, hk = work % num_kv_heads;
      const int64_t b = item_row[item];
      const int64_t begin = window_start(seq_lens[b], window) + (item - first[b]) * SPLIT_KEYS;
      const int64_t end = begin + SPLIT_KEYS;
      attend(&P, b, begin, end < seq_lens[b] ? end : seq_lens[b], hk, parts + item * part_size, scratch);
    }
    #pragma omp for schedule(static)
    for (int64_t b = 0; b < rows; ++b)
      if (scratch) merge(&P, parts + first[b] * part_size, first[b + 1] - first[b], b, scratch);
    free(scratch);
  }
  free(first), free(parts), free(item_row);
  return failed ? -1 : 0;
}
