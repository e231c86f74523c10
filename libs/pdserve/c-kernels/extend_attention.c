/* Paged extend attention, query tiles of one request (see pdserve/layers/attention/cpu_extend_kernel.py). */
#include "attention.h"

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
                      const int64_t* pages, int64_t base, int m, const char* q, int64_t q_bytes,
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
  for (int64_t first = 0; first < end; first += BLOCK) {
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
        const int64_t unseen = first + t0 + u - base; /* queries i < unseen come before this key */
        __m512 scores = _mm512_mul_ps(dots[u], _mm512_set1_ps(scale));
        if (t0 + u >= n) scores = _mm512_set1_ps(MASKED);
        else if (unseen > 0)
          scores = _mm512_mask_blend_ps((__mmask16)((1u << unseen) - 1), scores, _mm512_set1_ps(MASKED));
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
static void tile_head_64(int64_t ps, int64_t pb, int64_t tb, float scale, const int64_t* pages, int64_t base, int m,
                         const char* q, int64_t qb, const char* k, const char* v, bf16* out, int64_t oe,
                         const Buffers* B) {
  tile_head(64, 4, ps, pb, tb, scale, pages, base, m, q, qb, k, v, out, oe, B);
}
static void tile_head_128(int64_t ps, int64_t pb, int64_t tb, float scale, const int64_t* pages, int64_t base, int m,
                          const char* q, int64_t qb, const char* k, const char* v, bf16* out, int64_t oe,
                          const Buffers* B) {
  tile_head(128, 2, ps, pb, tb, scale, pages, base, m, q, qb, k, v, out, oe, B);
}

/* Extend attention of R requests: request r computes extend_lens[r] queries after prefix_lens[r]
   cached keys; its queries are rows row_starts[r] + i of q (row stride q_stride elements) and of
   out [T, Hq, D]; k, v: [num_pages, page_size, Hkv, D], pages page_stride elements apart (each
   page's rows contiguous); page_table [R, max_pages]; all bfloat16
   but the int64 index arrays. Returns 0, -1 for a head_dim without a tile kernel, or -2 when out of
   memory (out then incomplete). */
int extend_attention(const void* q, int64_t q_stride, const void* k, const void* v, void* out,
                     const int64_t* page_table, const int64_t* prefix_lens, const int64_t* extend_lens,
                     const int64_t* row_starts, int64_t num_reqs, int64_t max_pages, int64_t page_size,
                     int64_t page_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                     int num_threads) {
  if (head_dim != 64 && head_dim != 128) return -1;
  int64_t num_items = 0;
  for (int64_t r = 0; r < num_reqs; ++r) num_items += (extend_lens[r] + TILE - 1) / TILE;
  int64_t* items = malloc(sizeof(int64_t) * 2 * num_items); /* (request, first query) */
  if (!items) return -2;
  int failed = 0;
  for (int64_t r = 0, i = 0; r < num_reqs; ++r)
    for (int64_t q0 = 0; q0 < extend_lens[r]; q0 += TILE, ++i) items[2 * i] = r, items[2 * i + 1] = q0;
  const int64_t group = num_heads / num_kv_heads, head_bytes = head_dim * 2;
  const int64_t token_bytes = num_kv_heads * head_bytes, row_bytes = num_heads * head_dim;
  #pragma omp parallel num_threads(num_threads)
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
      const int m = extend_lens[r] - q0 < TILE ? (int)(extend_lens[r] - q0) : TILE;
      const int64_t row = row_starts[r] + q0, base = prefix_lens[r] + q0;
      const int64_t* pages = page_table + r * max_pages;
      for (int64_t h = 0; h < num_heads; ++h) {
        const char* qh = (const char*)q + (row * q_stride + h * head_dim) * 2;
        const int64_t kv = h / group * head_bytes;
        const char *kh = (const char*)k + kv, *vh = (const char*)v + kv;
        bf16* oh = (bf16*)out + row * row_bytes + h * head_dim;
        (head_dim == 64 ? tile_head_64 : tile_head_128)(page_size, page_stride * 2, token_bytes, scale, pages,
                                                        base, m, qh,
                                                        q_stride * 2, kh, vh, oh, row_bytes, &B);
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
