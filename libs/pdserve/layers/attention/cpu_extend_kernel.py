"""Paged extend attention for CPUs with AVX512-BF16: query tiles of one request, a lane per query.

An extend computes ``n`` new tokens of a request after ``p`` cached ones; query ``i`` (position
``p + i``) attends keys ``[0, p + i]``. One query at a time (``cpu_decode_kernel``) each key's
score is a dot product summed across the lanes of a vector, and the horizontal sums cost more than
the products. Here a work item is a tile of up to 16 queries of one request, one query per lane of
an AVX-512 float32 vector, so a key's 16 scores come out of one vector (FlashAttention's tiling,
Dao et al. 2022, laid out for CPU vector lanes):

1. the tile's queries of one head are transposed once into pairs ``qt[j] = (q[., 2j], q[., 2j+1])``
   (16 lanes of two bfloat16); the score vector of key ``t`` is ``sum_j qt[j] . k_t[2j:2j+2]`` by
   ``vdpbf16ps`` with the key's pair broadcast, exact products summed in float32, with no
   cross-lane work; eight keys run as independent chains;
2. the online softmax over a block of 16 keys is lane-wise (each lane is one query's running max
   and sum), keys past a query's own position masked;
3. ``acc[i] += sum_t p[t, i] * v_t`` by ``vdpbf16ps`` over key pairs: the probabilities rounded to
   bfloat16 pairs ``(p[t], p[t+1])`` (the softmax sums taken over the rounded values) and V rows
   ``t``, ``t+1`` interleaved element-wise, once for the few queries whose float32 accumulators
   stay in registers together.

Scores, softmax and accumulation are float32 and the output is rounded to nearest-even bfloat16,
as in the decode kernel; rounding the probabilities adds an error of at most 2^-8 of the weights
over ``|V|`` (the tests' bound). Only bfloat16 and head_dim 64 or 128 on CPUs with AVX512_BF16
(``supports``); other cases use the decode kernel or SDPA.

Layout as in ``cpu_decode_kernel``: q and out rows ``[T, Hq, D]`` (q rows may be strided), K/V
``[num_pages, page_size, Hkv, D]`` addressed through each request's page table.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.layers.attention.cpu_decode_kernel import PRELUDE
from pdserve.layers.native import AVX512_EXP, build_library

_SOURCE = (
    r"""
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define TILE 16        /* queries of a work item: one lane each */
#define MAX_GROUP 4    /* queries whose accumulators stay in registers in step 3 */

"""
    + AVX512_EXP
    + r"""
/* Per-thread buffers: qt [D / 2, TILE] int32 query pairs; s [BLOCK, TILE] scores; pairs
   [BLOCK / 2, TILE] bfloat16 probability pairs; acc [TILE, D] floats, each 32 elements of a row
   kept in the order the unpacked V pairs give them (see step 3). */
typedef struct { int32_t* qt; float* s; int32_t* pairs; float* acc; } Buffers;

/* One tile and one query head: queries i < m at positions base + i, their D elements at
   q + i * q_bytes, outputs at out + i * out_elems; k, v: the pools offset to the head's KV head.
   Pages of the request: pages; token_bytes: one token's K row of all KV heads. */
INLINE void tile_head(int D, int group, int64_t page_size, int64_t token_bytes, float scale,
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
      rows[t] = (pages[pos / page_size] * page_size + pos % page_size) * token_bytes;
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
static void tile_head_64(int64_t ps, int64_t tb, float scale, const int64_t* pages, int64_t base, int m,
                         const char* q, int64_t qb, const char* k, const char* v, bf16* out, int64_t oe,
                         const Buffers* B) {
  tile_head(64, 4, ps, tb, scale, pages, base, m, q, qb, k, v, out, oe, B);
}
static void tile_head_128(int64_t ps, int64_t tb, float scale, const int64_t* pages, int64_t base, int m,
                          const char* q, int64_t qb, const char* k, const char* v, bf16* out, int64_t oe,
                          const Buffers* B) {
  tile_head(128, 2, ps, tb, scale, pages, base, m, q, qb, k, v, out, oe, B);
}

/* Extend attention of R requests: request r computes extend_lens[r] queries after prefix_lens[r]
   cached keys; its queries are rows row_starts[r] + i of q (row stride q_stride elements) and of
   out [T, Hq, D]; k, v: [num_pages, page_size, Hkv, D]; page_table [R, max_pages]; all bfloat16
   but the int64 index arrays. Returns 0, or -1 for a head_dim without a tile kernel. */
int extend_attention(const void* q, int64_t q_stride, const void* k, const void* v, void* out,
                     const int64_t* page_table, const int64_t* prefix_lens, const int64_t* extend_lens,
                     const int64_t* row_starts, int64_t num_reqs, int64_t max_pages, int64_t page_size,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                     int num_threads) {
  if (head_dim != 64 && head_dim != 128) return -1;
  int64_t num_items = 0;
  for (int64_t r = 0; r < num_reqs; ++r) num_items += (extend_lens[r] + TILE - 1) / TILE;
  int64_t* items = malloc(sizeof(int64_t) * 2 * num_items); /* (request, first query) */
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
    #pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < num_items; ++i) {
      const int64_t r = items[2 * i], q0 = items[2 * i + 1];
      const int m = extend_lens[r] - q0 < TILE ? (int)(extend_lens[r] - q0) : TILE;
      const int64_t row = row_starts[r] + q0, base = prefix_lens[r] + q0;
      const int64_t* pages = page_table + r * max_pages;
      for (int64_t h = 0; h < num_heads; ++h) {
        const char* qh = (const char*)q + (row * q_stride + h * head_dim) * 2;
        const int64_t kv = h / group * head_bytes;
        const char *kh = (const char*)k + kv, *vh = (const char*)v + kv;
        bf16* oh = (bf16*)out + row * row_bytes + h * head_dim;
        (head_dim == 64 ? tile_head_64 : tile_head_128)(page_size, token_bytes, scale, pages, base, m, qh,
                                                        q_stride * 2, kh, vh, oh, row_bytes, &B);
      }
    }
    free(B.qt);
    free(B.s);
    free(B.pairs);
    free(B.acc);
  }
  free(items);
  return 0;
}
#endif
"""
)


class ExtendAttentionKernel:
    """``kernel(q, k_pages, v_pages, page_table, prefix_lens, extend_lens, row_starts, scale) -> out``.

    Args (CPU tensors, bfloat16 q and pages):
        q: ``[T, Hq, D]``; each row's ``Hq * D`` elements contiguous (rows may be strided).
        k_pages / v_pages: ``[num_pages, page_size, Hkv, D]``, one layer's K and V.
        page_table: int64 ``[R, max_pages]``: each request's KV pages.
        prefix_lens / extend_lens / row_starts: int64 ``[R]``: cached keys, new queries (>= 1) and
            the row of q holding the first of them, per request.
        scale: softmax scale.
        out: ``[T, Hq, D]`` written in the requests' rows (others untouched); allocated when None.
    Returns ``out``.

    Raises:
        ValueError: a head_dim without a tile kernel (``supports`` says which).
    """

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.extend_attention
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = (
            [ctypes.c_void_p, ctypes.c_int64]
            + [ctypes.c_void_p] * 7
            + [ctypes.c_int64] * 6
            + [ctypes.c_float, ctypes.c_int]
        )

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int) -> bool:
        return dtype == torch.bfloat16 and head_dim in (64, 128)

    def __call__(
        self,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        page_table: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        row_starts: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens, num_heads, head_dim = q.shape
        _, page_size, num_kv_heads, _ = k_pages.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        if out is None:
            out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype)
        page_table, prefix_lens, extend_lens, row_starts = (
            t.contiguous() for t in (page_table, prefix_lens, extend_lens, row_starts)
        )
        status = self._fn(
            q.data_ptr(),
            q.stride(0),
            k_pages.data_ptr(),
            v_pages.data_ptr(),
            out.data_ptr(),
            page_table.data_ptr(),
            prefix_lens.data_ptr(),
            extend_lens.data_ptr(),
            row_starts.data_ptr(),
            len(prefix_lens),
            page_table.shape[1],
            page_size,
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"no extend tile kernel for head_dim {head_dim}")
        return out


@functools.cache
def load_extend_kernel() -> ExtendAttentionKernel | None:
    """Build (once per source and CPU) and load the kernel; None without a C compiler or on a CPU
    without AVX512_BF16."""
    lib = build_library("extend_attention", PRELUDE + _SOURCE)
    if lib is None or not hasattr(lib, "extend_attention"):
        return None
    return ExtendAttentionKernel(lib)
