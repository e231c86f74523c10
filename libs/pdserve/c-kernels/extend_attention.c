/* Paged extend attention, query tiles of one request (see pdserve/layers/attention/cpu_extend_kernel.py):
   the float32 lane kernel every variant builds, and with AVX512_BF16 the bfloat16 pair kernel. */
#include "attention.h"

/* ---- The lane kernel: a tile of up to LANES queries of one request, one query per vector lane.
   Queries and K/V float32 or bfloat16 (widened: a block's K and V rows once per KV head, for all of
   its query heads), every product and sum float32, FMAs on vectors of LANES scores or outputs with
   the key's (value's) element broadcast. GCC vector types, so each variant's compiler flags pick the
   instructions (AVX-512: 16 lanes; AVX2 + FMA: 8; portable: 4, SSE2). */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX2__)
#define LANES 8
#else
#define LANES 4
#endif
#define KEYS 8  /* scores computed together: independent FMA chains */
#define CHUNK 8 /* output elements per query whose accumulators stay in registers in step 3 */

typedef float lanes_f __attribute__((vector_size(4 * LANES)));
typedef int32_t lanes_i __attribute__((vector_size(4 * LANES)));

INLINE lanes_f lanes_load(const float* p) {
  lanes_f v;
  memcpy(&v, p, sizeof v);
  return v;
}
INLINE void lanes_store(float* p, lanes_f v) { memcpy(p, &v, sizeof v); }
INLINE lanes_f lanes_set1(float x) { return (lanes_f){0} + x; }
INLINE lanes_f lanes_select(lanes_i mask, lanes_f a, lanes_f b) { /* a where mask, else b */
  return (lanes_f)(((lanes_i)a & mask) | ((lanes_i)b & ~mask));
}
INLINE lanes_f lanes_max(lanes_f a, lanes_f b) { return lanes_select(a > b, a, b); }

/* e^x lane-wise for x <= 0: exp_nonpositive's method (n = x / ln 2 rounded half away from zero). */
INLINE lanes_f lanes_exp(lanes_f x) {
  x = lanes_max(x, lanes_set1(-88.f));
  const lanes_i n = __builtin_convertvector(x * 1.44269504f - 0.5f, lanes_i);
  const lanes_f nf = __builtin_convertvector(n, lanes_f);
  lanes_f r = x - nf * 0.693145752f;
  __asm__("" : "+v"(r)); /* ln 2 in two parts: -ffast-math would add them first, losing the low part */
  r -= nf * 1.42860677e-6f;
  const lanes_f p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  return p * (lanes_f)((n + 127) << 23); /* 2^n; n = -127 gives 0 */
}

INLINE float load_elem(int is_bf16, const char* row, int64_t i) {
  return is_bf16 ? bf16_to_f32(((const bf16*)row)[i]) : ((const float*)row)[i];
}

/* Per-thread buffers: qt [group, D, LANES] the tile's queries transposed; acc [group, D,
   LANES] output sums; s [BLOCK, LANES] scores, then weights; max, sum [group, LANES] the online
   softmax's running max and sum; kv [2, BLOCK, D] a bfloat16 block's K and V rows widened. */
typedef struct { float *qt, *acc, *s, *max, *sum, *kv; } LaneBuffers;

/* The first key a tile attends: query 0 (position base) sees keys (base - window, base], and the
   tile's later queries later ones; all keys from 0 with window 0 (full attention). */
INLINE int64_t first_key(int64_t base, int64_t window) {
  return window && base >= window ? base - window + 1 : 0;
}

/* Queries i < m (positions base + i, row i at q + i * q_row_bytes) of the `group` query heads that
   share one KV head (head g at element g * D of a row) against that head's keys [first_key, base + m):
   k, v the pools offset to the KV head, pages of the request page_bytes apart, token_bytes per token. */
INLINE void lane_tile(int is_bf16, const int64_t D, int group, int64_t page_size, int64_t page_bytes,
                      int64_t token_bytes, float scale, int64_t window, const int64_t* pages, int64_t base, int m, const char* q,
                      int64_t q_row_bytes, const char* k, const char* v, char* out, int64_t out_row_bytes,
                      const LaneBuffers* B) {
  lanes_i lane;
  for (int i = 0; i < LANES; ++i) lane[i] = i;
  for (int g = 0; g < group; ++g) {
    for (int64_t d = 0; d < D; ++d)
      for (int i = 0; i < LANES; ++i)
        B->qt[(g * D + d) * LANES + i] = i < m ? load_elem(is_bf16, q + i * q_row_bytes, g * D + d) : 0.f;
    lanes_store(B->max + g * LANES, lanes_set1(-FLT_MAX));
    lanes_store(B->sum + g * LANES, lanes_set1(0.f));
  }
  memset(B->acc, 0, sizeof(float) * group * D * LANES);
  const int64_t end = base + m;
  const float *krow[BLOCK], *vrow[BLOCK];
  for (int64_t first = first_key(base, window); first < end; first += BLOCK) {
    const int n = end - first < BLOCK ? (int)(end - first) : BLOCK;
    for (int t = 0; t < n; ++t) {
      const int64_t pos = first + t, at = pages[pos / page_size] * page_bytes + pos % page_size * token_bytes;
      if (is_bf16) {
        float *kf = B->kv + t * D, *vf = B->kv + (BLOCK + t) * D;
        for (int64_t d = 0; d < D; ++d) kf[d] = load_elem(1, k + at, d), vf[d] = load_elem(1, v + at, d);
        krow[t] = kf, vrow[t] = vf;
      } else {
        krow[t] = (const float*)(k + at), vrow[t] = (const float*)(v + at);
      }
    }
    for (int g = 0; g < group; ++g) {
      const float* qt = B->qt + g * D * LANES;
      float *acc = B->acc + g * D * LANES, *s = B->s;
      /* 1. scores, KEYS keys at a time (past n: key 0 of the block again, not stored); a key after
         a query's own position, or outside its window, is masked for that query's lane */
      for (int t0 = 0; t0 < n; t0 += KEYS) {
        lanes_f dots[KEYS];
        const float* keys[KEYS];
        for (int u = 0; u < KEYS; ++u) dots[u] = lanes_set1(0.f), keys[u] = krow[t0 + u < n ? t0 + u : 0];
        for (int64_t d = 0; d < D; ++d) {
          const lanes_f qd = lanes_load(qt + d * LANES);
          for (int u = 0; u < KEYS; ++u) dots[u] += qd * lanes_set1(keys[u][d]);
        }
        for (int u = 0; u < KEYS && t0 + u < n; ++u) {
          /* queries i < unseen come before this key; those from `far` on are a window past it */
          const int64_t unseen = first + t0 + u - base, far = unseen + window;
          lanes_f score = dots[u] * scale;
          if (unseen > 0) score = lanes_select(lane < (int32_t)unseen, lanes_set1(MASKED), score);
          if (window && far < LANES) score = lanes_select(lane >= (int32_t)far, lanes_set1(MASKED), score);
          lanes_store(s + (t0 + u) * LANES, score);
        }
      }
      /* 2. online softmax, lane-wise (every lane sees a key of the first block, so its max is real) */
      const lanes_f old = lanes_load(B->max + g * LANES);
      lanes_f top = old;
      for (int t = 0; t < n; ++t) top = lanes_max(top, lanes_load(s + t * LANES));
      const lanes_f correction = lanes_exp(old - top);
      lanes_f sum = lanes_load(B->sum + g * LANES) * correction;
      for (int t = 0; t < n; ++t) {
        const lanes_f p = lanes_exp(lanes_load(s + t * LANES) - top);
        lanes_store(s + t * LANES, p);
        sum += p;
      }
      lanes_store(B->max + g * LANES, top);
      lanes_store(B->sum + g * LANES, sum);
      /* 3. acc = acc * correction + sum_t p_t v_t, CHUNK output elements at a time */
      for (int64_t d0 = 0; d0 < D; d0 += CHUNK) {
        lanes_f a[CHUNK];
        for (int j = 0; j < CHUNK; ++j) a[j] = lanes_load(acc + (d0 + j) * LANES) * correction;
        for (int t = 0; t < n; ++t) {
          const lanes_f p = lanes_load(s + t * LANES);
          for (int j = 0; j < CHUNK; ++j) a[j] += p * lanes_set1(vrow[t][d0 + j]);
        }
        for (int j = 0; j < CHUNK; ++j) lanes_store(acc + (d0 + j) * LANES, a[j]);
      }
    }
  }
  for (int g = 0; g < group; ++g)
    for (int i = 0; i < m; ++i) {
      const float inverse = 1.f / B->sum[g * LANES + i];
      for (int64_t d = 0; d < D; ++d) {
        const float o = B->acc[(g * D + d) * LANES + i] * inverse;
        char* row = out + i * out_row_bytes;
        if (is_bf16) ((bf16*)row)[g * D + d] = f32_to_bf16(o);
        else ((float*)row)[g * D + d] = o;
      }
    }
}

/* A literal head_dim each for the usual sizes, so the loops over it unroll. */
#define LANE_TILE_ARGS                                                                                  \
  int is_bf16, int group, int64_t ps, int64_t pb, int64_t tb, float scale, int64_t window, const int64_t *pages, \
      int64_t base, int m, const char *q, int64_t qb, const char *k, const char *v, char *out, int64_t ob,       \
      const LaneBuffers *B
#define LANE_TILE_PASS group, ps, pb, tb, scale, window, pages, base, m, q, qb, k, v, out, ob, B
static void lane_tile_64(LANE_TILE_ARGS) { lane_tile(is_bf16, 64, LANE_TILE_PASS); }
static void lane_tile_128(LANE_TILE_ARGS) { lane_tile(is_bf16, 128, LANE_TILE_PASS); }
static void lane_tile_any(int64_t D, LANE_TILE_ARGS) { lane_tile(is_bf16, D, LANE_TILE_PASS); }

/* ---- The pair kernel (AVX512_BF16, bfloat16, head_dim 64 or 128): see cpu_extend_kernel.py. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define TILE 16        /* queries of a work item: one lane each */
#define MAX_GROUP 4    /* queries whose accumulators stay in registers in step 3 */

/* Per-thread buffers: qt [D / 2, TILE] int32 query pairs; s [BLOCK, TILE] scores; pairs
   [BLOCK / 2, TILE] bfloat16 probability pairs; acc [TILE, D] floats, each 32 elements of a row
   kept in the order the unpacked V pairs give them (see step 3). */
typedef struct { int32_t* qt; float* s; int32_t* pairs; float* acc; } Buffers;

/* One tile and one query head: queries i < m at positions base + i, their D elements at
   q + i * q_bytes, outputs at out + i * out_elems; k, v: the pools offset to the head's KV head.
   Pages of the request: pages, page_bytes apart in the pools; token_bytes: one token's K row of all
   KV heads. */
INLINE void tile_head(int D, int group, int64_t page_size, int64_t page_bytes, int64_t token_bytes, float scale,
                      int64_t window, const int64_t* pages, int64_t base, int m, const char* q, int64_t q_bytes,
                      const char* k, const char* v, bf16* out, int64_t out_elems, const Buffers* B) {
  int32_t* qt = B->qt;
  float *s = B->s, *acc = B->acc;
  for (int j = 0; j < D / 2; ++j)
    for (int i = 0; i < TILE; ++i) {
      int32_t pair = 0;
      if (i < m) memcpy(&pair, q + i * q_bytes + 4 * j, 4);
      qt[j * TILE + i] = pair;
    }
  /* lane i: element i / 2 of p0 (even i) or of p1 (odd i), p1 being elements 16-31 of cvtne2ps */
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                              24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                              16, 0);
  __m512 max = _mm512_set1_ps(-FLT_MAX), sum = _mm512_setzero_ps();
  float corr[TILE];
  memset(acc, 0, sizeof(float) * TILE * D);
  const int64_t end = base + m;
  int64_t rows[BLOCK];
  for (int64_t first = first_key(base, window); first < end; first += BLOCK) {
    const int n = end - first < BLOCK ? (int)(end - first) : BLOCK;
    for (int t = 0; t < n; ++t) {
      const int64_t pos = first + t;
      rows[t] = pages[pos / page_size] * page_bytes + pos % page_size * token_bytes;
    }
    /* 1. scores, eight keys at a time; keys from n on repeat key 0 and are masked */
    for (int t0 = 0; t0 < BLOCK; t0 += 8) {
      __m512 dots[8];
      const char* keys[8];
      for (int u = 0; u < 8; ++u) {
        dots[u] = _mm512_setzero_ps();
        keys[u] = k + rows[t0 + u < n ? t0 + u : 0];
      }
      for (int j = 0; j < D / 2; ++j) {
        const __m512bh qj = (__m512bh)_mm512_loadu_si512(qt + j * TILE);
        for (int u = 0; u < 8; ++u) {
          int32_t pair;
          memcpy(&pair, keys[u] + 4 * j, 4);
          dots[u] = _mm512_dpbf16_ps(dots[u], qj, (__m512bh)_mm512_set1_epi32(pair));
        }
      }
      for (int u = 0; u < 8; ++u) {
        /* queries i < unseen come before this key; those from `far` on are a window past it */
        const int64_t unseen = first + t0 + u - base, far = unseen + window;
        unsigned masked = unseen > 0 ? (1u << unseen) - 1 : 0;
        if (window && far < TILE) masked |= 0xFFFFu & ~((1u << far) - 1);
        __m512 scores = _mm512_mul_ps(dots[u], _mm512_set1_ps(scale));
        if (t0 + u >= n) scores = _mm512_set1_ps(MASKED);
        else if (masked) scores = _mm512_mask_blend_ps((__mmask16)masked, scores, _mm512_set1_ps(MASKED));
        _mm512_storeu_ps(s + (t0 + u) * TILE, scores);
      }
    }
    /* 2. online softmax, lane-wise; probabilities rounded to bfloat16 pairs (keys 2u, 2u + 1), the
       sums taken over the rounded values so that the weights add up to exactly what divides */
    __m512 top = max;
    for (int t = 0; t < BLOCK; ++t) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t * TILE));
    const __m512 correction = exp512(_mm512_sub_ps(max, top));
    _mm512_storeu_ps(corr, correction);
    sum = _mm512_mul_ps(sum, correction);
    max = top;
    for (int u = 0; u < BLOCK / 2; ++u) {
      const __m512 p0 = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + 2 * u * TILE), top));
      const __m512 p1 = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + (2 * u + 1) * TILE), top));
      const __m512i pair = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      sum = _mm512_add_ps(sum, _mm512_add_ps(bf16_even(pair), bf16_odd(pair)));
      _mm512_storeu_si512(B->pairs + u * TILE, pair);
    }
    /* 3. acc = acc * corr + p . V by vdpbf16ps over key pairs: rows 2u and 2u + 1 of V interleaved
       element-wise (unpack works within 128-bit lanes, so of a 32-element chunk the low vector
       holds elements 8L + 0..3 and the high one 8L + 4..7 of each lane L); `group` queries'
       accumulators in registers, each V pair unpacked once for all of them */
    for (int g = 0; g < m; g += group) {
      __m512 sums[MAX_GROUP][8];
      for (int r = 0; r < group; ++r) {
        const __m512 c = _mm512_set1_ps(corr[g + r]);
        for (int x = 0; x < D / 16; ++x)
          sums[r][x] = _mm512_mul_ps(c, _mm512_loadu_ps(acc + (g + r) * D + 16 * x));
      }
      for (int u = 0; 2 * u < n; ++u) {
        const char *v0 = v + rows[2 * u], *v1 = v + rows[2 * u + 1 < n ? 2 * u + 1 : 2 * u];
        __m512bh vv[8];
        for (int c = 0; c < D / 32; ++c) {
          const __m512i a = _mm512_loadu_si512(v0 + 64 * c), b = _mm512_loadu_si512(v1 + 64 * c);
          vv[2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
          vv[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
        }
        for (int r = 0; r < group; ++r) {
          const __m512bh pr = (__m512bh)_mm512_set1_epi32(B->pairs[u * TILE + g + r]);
          for (int x = 0; x < D / 16; ++x) sums[r][x] = _mm512_dpbf16_ps(sums[r][x], pr, vv[x]);
        }
      }
      for (int r = 0; r < group; ++r)
        for (int x = 0; x < D / 16; ++x) _mm512_storeu_ps(acc + (g + r) * D + 16 * x, sums[r][x]);
    }
  }
  float l[TILE];
  _mm512_storeu_ps(l, sum);
  for (int i = 0; i < m; ++i)
    for (int c = 0; c < D / 32; ++c)
      for (int e = 0; e < 16; ++e) {
        const int dim = 32 * c + 8 * (e / 4) + e % 4;
        out[i * out_elems + dim] = f32_to_bf16(acc[i * D + 32 * c + e] / l[i]);
        out[i * out_elems + dim + 4] = f32_to_bf16(acc[i * D + 32 * c + 16 + e] / l[i]);
      }
}

/* A literal head_dim (and the queries per register group it allows) each, so the loops unroll. */
static void tile_head_64(int64_t ps, int64_t pb, int64_t tb, float scale, int64_t window, const int64_t* pages,
                         int64_t base, int m, const char* q, int64_t qb, const char* k, const char* v, bf16* out,
                         int64_t oe, const Buffers* B) {
  tile_head(64, 4, ps, pb, tb, scale, window, pages, base, m, q, qb, k, v, out, oe, B);
}
static void tile_head_128(int64_t ps, int64_t pb, int64_t tb, float scale, int64_t window, const int64_t* pages,
                          int64_t base, int m, const char* q, int64_t qb, const char* k, const char* v, bf16* out,
                          int64_t oe, const Buffers* B) {
  tile_head(128, 2, ps, pb, tb, scale, window, pages, base, m, q, qb, k, v, out, oe, B);
}

#endif

/* ---- The driver. */

/* The arguments of one extend_attention call. */
typedef struct {
  const char *q, *k, *v;
  char* out;
  const int64_t *page_table, *prefix_lens, *extend_lens, *row_starts;
  int64_t q_stride, num_reqs, max_pages, page_size, page_stride, num_heads, num_kv_heads, head_dim, window;
  float scale;
  int is_bf16, threads;
} Extend;

/* Work items of up to `tile` queries of one request: (request, first query) pairs, *count of them;
   NULL when out of memory. */
static int64_t* tile_items(const Extend* e, int tile, int64_t* count) {
  int64_t n = 0;
  for (int64_t r = 0; r < e->num_reqs; ++r) n += (e->extend_lens[r] + tile - 1) / tile;
  int64_t* items = malloc(sizeof(int64_t) * 2 * (n ? n : 1));
  if (items)
    for (int64_t r = 0, i = 0; r < e->num_reqs; ++r)
      for (int64_t q0 = 0; q0 < e->extend_lens[r]; q0 += tile, ++i) items[2 * i] = r, items[2 * i + 1] = q0;
  *count = n;
  return items;
}

/* The lane kernel over every (tile, KV head). Returns 0, or -2 when out of memory. */
static int run_lane_tiles(const Extend* e) {
  int64_t num_tiles;
  int64_t* items = tile_items(e, LANES, &num_tiles);
  if (!items) return -2;
  const int64_t D = e->head_dim, group = e->num_heads / e->num_kv_heads, esize = e->is_bf16 ? 2 : 4;
  const int64_t token_bytes = e->num_kv_heads * D * esize, out_row_bytes = e->num_heads * D * esize;
  int failed = 0;
  #pragma omp parallel num_threads(e->threads)
  {
    const LaneBuffers B = {malloc(sizeof(float) * group * D * LANES), malloc(sizeof(float) * group * D * LANES),
                           malloc(sizeof(float) * BLOCK * LANES), malloc(sizeof(float) * group * LANES),
                           malloc(sizeof(float) * group * LANES), malloc(sizeof(float) * 2 * BLOCK * D)};
    const int ok = B.qt && B.acc && B.s && B.max && B.sum && B.kv;
    if (!ok) {
      #pragma omp atomic write
      failed = 1;
    }
    #pragma omp for schedule(dynamic)
    for (int64_t w = 0; w < num_tiles * e->num_kv_heads; ++w) {
      if (!ok) continue; /* every thread still takes part in the worksharing loop */
      const int64_t i = w / e->num_kv_heads, h = w % e->num_kv_heads, r = items[2 * i], q0 = items[2 * i + 1];
      const int m = e->extend_lens[r] - q0 < LANES ? (int)(e->extend_lens[r] - q0) : LANES;
      const int64_t row = e->row_starts[r] + q0, base = e->prefix_lens[r] + q0;
      const char* q = e->q + (row * e->q_stride + h * group * D) * esize;
      const char *k = e->k + h * D * esize, *v = e->v + h * D * esize;
      char* out = e->out + (row * e->num_heads + h * group) * D * esize;
      const int64_t* pages = e->page_table + r * e->max_pages;
      const int64_t pb = e->page_stride * esize, qb = e->q_stride * esize;
      if (D == 64)
        lane_tile_64(e->is_bf16, group, e->page_size, pb, token_bytes, e->scale, e->window, pages, base, m, q, qb, k,
                     v, out, out_row_bytes, &B);
      else if (D == 128)
        lane_tile_128(e->is_bf16, group, e->page_size, pb, token_bytes, e->scale, e->window, pages, base, m, q, qb, k,
                      v, out, out_row_bytes, &B);
      else
        lane_tile_any(D, e->is_bf16, group, e->page_size, pb, token_bytes, e->scale, e->window, pages, base, m, q, qb,
                      k, v, out, out_row_bytes, &B);
    }
    free(B.qt), free(B.acc), free(B.s), free(B.max), free(B.sum), free(B.kv);
  }
  free(items);
  return failed ? -2 : 0;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* The pair kernel over every tile (all heads of a tile in turn). Returns 0, or -2 when out of memory. */
static int run_pair_tiles(const Extend* e) {
  int64_t num_items;
  int64_t* items = tile_items(e, TILE, &num_items);
  if (!items) return -2;
  int failed = 0;
  const int64_t head_dim = e->head_dim, group = e->num_heads / e->num_kv_heads, head_bytes = head_dim * 2;
  const int64_t token_bytes = e->num_kv_heads * head_bytes, row_bytes = e->num_heads * head_dim;
  #pragma omp parallel num_threads(e->threads)
  {
    const Buffers B = {aligned_alloc(64, sizeof(int32_t) * head_dim / 2 * TILE),
                       aligned_alloc(64, sizeof(float) * BLOCK * TILE),
                       aligned_alloc(64, sizeof(int32_t) * BLOCK / 2 * TILE),
                       aligned_alloc(64, sizeof(float) * TILE * head_dim)};
    const int ok = B.qt && B.s && B.pairs && B.acc;
    if (!ok) {
      #pragma omp atomic write
      failed = 1;
    }
    #pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < num_items; ++i) {
      if (!ok) continue; /* every thread still takes part in the worksharing loop */
      const int64_t r = items[2 * i], q0 = items[2 * i + 1];
      const int m = e->extend_lens[r] - q0 < TILE ? (int)(e->extend_lens[r] - q0) : TILE;
      const int64_t row = e->row_starts[r] + q0, base = e->prefix_lens[r] + q0;
      const int64_t* pages = e->page_table + r * e->max_pages;
      for (int64_t h = 0; h < e->num_heads; ++h) {
        const char* qh = e->q + (row * e->q_stride + h * head_dim) * 2;
        const int64_t kv = h / group * head_bytes;
        bf16* oh = (bf16*)e->out + row * row_bytes + h * head_dim;
        (head_dim == 64 ? tile_head_64 : tile_head_128)(e->page_size, e->page_stride * 2, token_bytes, e->scale,
                                                        e->window, pages, base, m, qh, e->q_stride * 2, e->k + kv,
                                                        e->v + kv, oh, row_bytes, &B);
      }
    }
    free(B.qt);
    free(B.s);
    free(B.pairs);
    free(B.acc);
  }
  free(items);
  return failed ? -2 : 0;
}
#endif

/* Extend attention of R requests: request r computes extend_lens[r] queries after prefix_lens[r]
   cached keys; its queries are rows row_starts[r] + i of q (row stride q_stride elements) and of
   out [T, Hq, D]; k, v: [num_pages, page_size, Hkv, D], pages page_stride elements apart (each
   page's rows contiguous); page_table [R, max_pages]; window: keys a query attends, its own and
   the ones before it (a sliding-window layer), 0 for all. q, K/V and out all float32, or all bfloat16
   (is_bf16); the index arrays int64. bfloat16 with head_dim 64 or 128 runs the pair kernel where
   the variant has AVX512_BF16, everything else the lane kernel. Returns 0, -1 for a head_dim
   without a kernel (not a multiple of 8, or over 512), or -2 when out of memory (out then
   incomplete). */
int extend_attention(const void* q, int64_t q_stride, const void* k, const void* v, void* out,
                     const int64_t* page_table, const int64_t* prefix_lens, const int64_t* extend_lens,
                     const int64_t* row_starts, int64_t num_reqs, int64_t max_pages, int64_t page_size,
                     int64_t page_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t window,
                     float scale, int is_bf16, int num_threads) {
  const Extend e = {q, k, v, out, page_table, prefix_lens, extend_lens, row_starts, q_stride, num_reqs, max_pages,
                    page_size, page_stride, num_heads, num_kv_heads, head_dim, window, scale, is_bf16, num_threads};
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (is_bf16 && (head_dim == 64 || head_dim == 128)) return run_pair_tiles(&e);
#endif
  if (head_dim % CHUNK || head_dim > 512) return -1;
  return run_lane_tiles(&e);
}
