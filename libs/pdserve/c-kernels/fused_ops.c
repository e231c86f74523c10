/* Fused element-wise ops (see pdserve/layers/cpu_fused_ops.py): residual-add + RMSNorm, in-place
   rotary embedding, SiLU-and-mul, storing K/V rows in the pool, the greedy argmax, and the per-row
   int8 quantization and row-scaled epilogue of W8A8 matmuls; each for float32 and bfloat16. */
#include "common.h"
#include "quantize.h"

static inline float load_f32(float x) { return x; }
static inline float round_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }
static inline float load_bf16(uint16_t x) { return bf16_to_f32(x); }
static inline uint16_t store_bf16(float f) { return f32_to_bf16(f); }


/* rows run in parallel when there are enough of them to pay for waking the other threads */
#define PARALLEL_ROWS _Pragma("omp parallel for schedule(static) if(rows >= 8) num_threads(threads)")

/* x, out: [rows, hidden] (row strides in elements); residual: NULL or [rows, hidden], contiguous.
   With a residual: s = round(x + residual) is written back to residual (the next layer's
   residual), then out = round(w * round(s * rsqrt(mean(s^2) + eps))). */
#define DEFINE_ADD_RMSNORM(NAME, T, LOAD, STORE, ROUND)                                            \
void NAME(const T* x, int64_t x_stride, T* residual, const T* w, T* out, int64_t rows,            \
          int64_t hidden, float eps, int threads) {                                                \
  PARALLEL_ROWS                                                                                    \
  for (int64_t r = 0; r < rows; ++r) {                                                             \
    const T* xr = x + r * x_stride;                                                                \
    T* o = out + r * hidden;                                                                       \
    float sum = 0.f;                                                                               \
    if (residual) {                                                                                \
      T* res = residual + r * hidden;                                                              \
      for (int64_t i = 0; i < hidden; ++i) {                                                       \
        float s = ROUND(LOAD(xr[i]) + LOAD(res[i]));                                              \
        res[i] = STORE(s);                                                                         \
        sum += s * s;                                                                              \
      }                                                                                            \
      xr = res;                                                                                    \
    } else {                                                                                       \
      for (int64_t i = 0; i < hidden; ++i) { float s = LOAD(xr[i]); sum += s * s; }               \
    }                                                                                              \
    const float inv = 1.f / sqrtf(sum / (float)hidden + eps);                                      \
    for (int64_t i = 0; i < hidden; ++i) o[i] = STORE(LOAD(w[i]) * ROUND(LOAD(xr[i]) * inv));     \
  }                                                                                                \
}

/* q: [tokens, num_q_heads * head_dim] and k: [tokens, num_k_heads * head_dim] with row strides
   (elements), rotated in place in the NeoX "rotate half" layout: for i < head_dim / 2,
   (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). cos_sin: float32 [max_position, head_dim]
   (cos of the half dims, then sin), cast to T as the activations are; positions: [tokens]. */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE, ROUND)                                                 \
static inline void NAME##_heads(T* x, int64_t heads, int64_t half, const float* cs) {              \
  for (int64_t h = 0; h < heads; ++h) {                                                            \
    T* x1 = x + h * 2 * half; T* x2 = x1 + half;                                                   \
    for (int64_t i = 0; i < half; ++i) {                                                           \
      const float c = ROUND(cs[i]), s = ROUND(cs[half + i]);                                       \
      const float a = LOAD(x1[i]), b = LOAD(x2[i]);                                                \
      x1[i] = STORE(ROUND(a * c) - ROUND(b * s));                                                  \
      x2[i] = STORE(ROUND(b * c) + ROUND(a * s));                                                  \
    }                                                                                              \
  }                                                                                                \
}                                                                                                  \
void NAME(T* q, int64_t q_stride, int64_t num_q_heads, T* k, int64_t k_stride,                    \
          int64_t num_k_heads, int64_t head_dim, const float* cos_sin, const int64_t* positions,   \
          int64_t rows, int threads) {                                                             \
  const int64_t half = head_dim / 2;                                                               \
  PARALLEL_ROWS                                                                                    \
  for (int64_t t = 0; t < rows; ++t) {                                                             \
    const float* cs = cos_sin + positions[t] * head_dim;                                           \
    NAME##_heads(q + t * q_stride, num_q_heads, half, cs);                                         \
    NAME##_heads(k + t * k_stride, num_k_heads, half, cs);                                         \
  }                                                                                                \
}

/* x: [rows, 2 * d] = [gate | up] (row stride 2d); out: [rows, d] = round(round(silu(gate)) * up). */
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE, ROUND)                                           \
void NAME(const T* x, T* out, int64_t rows, int64_t d, int threads) {                              \
  PARALLEL_ROWS                                                                                    \
  for (int64_t r = 0; r < rows; ++r) {                                                             \
    const T *gate = x + r * 2 * d, *up = gate + d;                                                 \
    T* o = out + r * d;                                                                            \
    int64_t i = VECTOR_SILU_##T(gate, up, o, d);                                                   \
    for (; i < d; ++i) {                                                                           \
      const float g = LOAD(gate[i]);                                                               \
      o[i] = STORE(ROUND(g / (1.f + expf(fminf(-g, 80.f)))) * LOAD(up[i]));                        \
    }                                                                                              \
  }                                                                                                \
}

#if defined(__AVX512F__)
/* The bfloat16 rows 16 elements at a time (silu_mul16_bf16); returns how many elements it did. */
static inline int64_t vector_silu_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* o, int64_t d) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    _mm256_storeu_si256((void*)(o + i), silu_mul16_bf16(load16_bf16(gate + i), load16_bf16(up + i)));
  return i;
}
#define VECTOR_SILU_uint16_t(gate, up, o, d) vector_silu_bf16(gate, up, o, d)
#elif defined(__AVX2__)
/* The same 8 elements at a time, with the same roundings. */
static inline int64_t vector_silu_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* o, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 silu = bf16_to_f32_8(round8_bf16(silu256(load8_bf16(gate + i))));
    store8_bf16(o + i, _mm256_mul_ps(silu, load8_bf16(up + i)));
  }
  return i;
}
#define VECTOR_SILU_uint16_t(gate, up, o, d) vector_silu_bf16(gate, up, o, d)
#else
#define VECTOR_SILU_uint16_t(gate, up, o, d) 0
#endif
#define VECTOR_SILU_float(gate, up, o, d) 0  /* float32 keeps libm's expf (vectorised by the compiler) */

/* This step's K and V rows into the KV pool: row t of k (v), elems elements at k + t * k_stride
   (bytes; a view into a fused qkv tensor), goes to token slot loc[t] of k_pool (v_pool): offset
   loc[t] % page_size rows into page loc[t] / page_size, the pool's pages page_bytes apart. Rows and
   pool of one dtype (elem_bytes each, copied), or float32 rows into a bfloat16 pool (to_bf16:
   rounded to nearest even). */
void store_kv(const char* k, int64_t k_stride, const char* v, int64_t v_stride, char* k_pool,
              char* v_pool, const int64_t* loc, int64_t rows, int64_t elems, int64_t elem_bytes, int to_bf16,
              int64_t page_size, int64_t page_bytes, int threads) {
  const int64_t row_bytes = elems * (to_bf16 ? 2 : elem_bytes);
  #pragma omp parallel for schedule(static) if(rows * row_bytes >= (1 << 18)) num_threads(threads)
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t at = loc[t] / page_size * page_bytes + loc[t] % page_size * row_bytes;
    if (to_bf16) {
      const float *kt = (const float*)(k + t * k_stride), *vt = (const float*)(v + t * v_stride);
      bf16 *kd = (bf16*)(k_pool + at), *vd = (bf16*)(v_pool + at);
      for (int64_t i = 0; i < elems; ++i) kd[i] = f32_to_bf16(kt[i]), vd[i] = f32_to_bf16(vt[i]);
    } else {
      memcpy(k_pool + at, k + t * k_stride, row_bytes);
      memcpy(v_pool + at, v + t * v_stride, row_bytes);
    }
  }
}

/* out[r] = the first index of the largest value of row r of x [rows, cols] (contiguous, finite or
   -inf). With AVX-512 (AVX2) each lane keeps the first index of its own largest value (only a strictly
   larger one replaces it); the row's answer is the smallest such index among the lanes holding
   the largest value, then the tail past the last full vector is scanned in order. */
#ifdef __AVX512F__
static inline __m512 vload_f32(const float* x) { return _mm512_loadu_ps(x); }
static inline __m512 vload_bf16(const uint16_t* x) { return load16_bf16(x); }
#define VECTOR_ARGMAX(T, LOAD16)                                                                   \
  if (cols >= 16) {                                                                                \
    __m512 top = LOAD16(row);                                                                      \
    const __m512i step = _mm512_set1_epi32(16);                                                    \
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), where = at; \
    for (i = 16; i + 16 <= cols; i += 16) {                                                        \
      at = _mm512_add_epi32(at, step);                                                             \
      const __m512 v = LOAD16(row + i);                                                            \
      const __mmask16 larger = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);                             \
      top = _mm512_mask_blend_ps(larger, top, v);                                                  \
      where = _mm512_mask_blend_epi32(larger, where, at);                                          \
    }                                                                                              \
    best = _mm512_reduce_max_ps(top);                                                              \
    const __mmask16 holders = _mm512_cmp_ps_mask(top, _mm512_set1_ps(best), _CMP_EQ_OQ);           \
    index = _mm512_mask_reduce_min_epi32(holders, where);                                          \
  }
#elif defined(__AVX2__)
static inline __m256 vload_f32(const float* x) { return _mm256_loadu_ps(x); }
static inline __m256 vload_bf16(const uint16_t* x) { return load8_bf16(x); }
#define VECTOR_ARGMAX(T, VLOAD)                                                                    \
  if (cols >= 8) {                                                                                 \
    __m256 top = VLOAD(row);                                                                       \
    const __m256i step = _mm256_set1_epi32(8);                                                     \
    __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), where = at;                            \
    for (i = 8; i + 8 <= cols; i += 8) {                                                           \
      at = _mm256_add_epi32(at, step);                                                             \
      const __m256 v = VLOAD(row + i);                                                             \
      const __m256 larger = _mm256_cmp_ps(v, top, _CMP_GT_OQ);                                     \
      top = _mm256_blendv_ps(top, v, larger);                                                      \
      where = _mm256_castps_si256(                                                                 \
          _mm256_blendv_ps(_mm256_castsi256_ps(where), _mm256_castsi256_ps(at), larger));          \
    }                                                                                              \
    float tops[8];                                                                                 \
    int32_t wheres[8];                                                                             \
    _mm256_storeu_ps(tops, top);                                                                   \
    _mm256_storeu_si256((void*)wheres, where);                                                     \
    best = tops[0], index = wheres[0];                                                             \
    for (int lane = 1; lane < 8; ++lane)                                                           \
      if (tops[lane] > best || (tops[lane] == best && wheres[lane] < index))                       \
        best = tops[lane], index = wheres[lane];                                                   \
  }
#else
#define VECTOR_ARGMAX(T, LOAD16)
#endif
#define DEFINE_ARGMAX(NAME, T, LOAD, VLOAD)                                                       \
void NAME(const T* x, int64_t rows, int64_t cols, int64_t* out, int threads) {                     \
  _Pragma("omp parallel for schedule(static) if(rows * cols >= (1 << 16)) num_threads(threads)")   \
  for (int64_t r = 0; r < rows; ++r) {                                                             \
    const T* row = x + r * cols;                                                                   \
    float best = LOAD(row[0]);                                                                     \
    int64_t index = 0, i = 1;                                                                      \
    VECTOR_ARGMAX(T, VLOAD)                                                                        \
    for (; i < cols; ++i) {                                                                        \
      const float value = LOAD(row[i]);                                                            \
      if (value > best) best = value, index = i;                                                   \
    }                                                                                              \
    out[r] = index;                                                                                \
  }                                                                                                \
}

/* Per-row symmetric int8, stored offset by 128 as uint8 (oneDNN's u8 activations with zero point
   128): x [rows, cols] (row stride in elements) -> q [rows, cols] uint8 with scales[r] = max|x_r| / 127
   and q - 128 = round-half-even(x * (127 / max|x_r|)) (128 everywhere for a zero row); -ffast-math
   may round the two divisions differently in the last bit, which can move a value that lies on a
   .5 boundary by one step. */
#define DEFINE_QUANTIZE_ROWS(NAME, T, LOAD)                                                        \
void NAME(const T* x, int64_t x_stride, int64_t rows, int64_t cols, uint8_t* q, float* scales,     \
          int threads) {                                                                           \
  PARALLEL_ROWS                                                                                    \
  for (int64_t r = 0; r < rows; ++r) {                                                             \
    const T* xr = x + r * x_stride;                                                                \
    float amax = 0.f;                                                                              \
    for (int64_t i = 0; i < cols; ++i) amax = fmaxf(amax, fabsf(LOAD(xr[i])));                    \
    const float inv = quantize_inverse(amax);                                                      \
    uint8_t* qr = q + r * cols;                                                                    \
    for (int64_t i = 0; i < cols; ++i) qr[i] = (uint8_t)(128 + quantize_value(LOAD(xr[i]), inv));  \
    scales[r] = amax / 127.f;                                                                      \
  }                                                                                                \
}

#define DEFINE_ALL(SUFFIX, T, LOAD, STORE, ROUND)                                                  \
DEFINE_ADD_RMSNORM(add_rmsnorm_##SUFFIX, T, LOAD, STORE, ROUND)                                    \
DEFINE_ROTARY(rotary_##SUFFIX, T, LOAD, STORE, ROUND)                                              \
DEFINE_SILU_AND_MUL(silu_and_mul_##SUFFIX, T, LOAD, STORE, ROUND)                                  \
DEFINE_ARGMAX(argmax_##SUFFIX, T, LOAD, vload_##SUFFIX)                                           \
DEFINE_QUANTIZE_ROWS(quantize_rows_##SUFFIX, T, LOAD)

DEFINE_ALL(f32, float, load_f32, store_f32, round_f32)
DEFINE_ALL(bf16, uint16_t, load_bf16, store_bf16, round_bf16)
