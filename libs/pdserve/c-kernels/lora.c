/* The mixed-adapter LoRA delta of one linear layer (see pdserve/lora/bgmv.py), BGMV-style (Punica's
   batched gather matrix-vector product, Chen et al. 2023): every token gathers its own adapter's
   low-rank weights, so a batch of any mix of adapters is one call; as in Punica's SGMV, tokens of
   one adapter share each load of its weights (tiles of up to TILE tokens). */
#include "common.h"

#define EXPAND_COLS 64 /* output columns summed in one block of float32 accumulators */
#define TILE 8         /* tokens of one adapter that share each load of its weights */

/* h[k * width + w] = sum_i x_k[i] * a[i * width + w] for the n tokens k of a tile (x_k: row rows[k]
   of x): the shrink x @ A^T, each row of a loaded once for the whole tile. */
#define DEFINE_SHRINK(NAME, T, LOAD)                                                               \
static inline void NAME(const T* x, int64_t x_stride, const int64_t* rows, int64_t n, int64_t in,  \
                        const float* a, int64_t width, float* h) {                                 \
  for (int64_t w = 0; w < n * width; ++w) h[w] = 0.f;                                              \
  for (int64_t i = 0; i < in; ++i) {                                                               \
    const float* ar = a + i * width;                                                               \
    for (int64_t k = 0; k < n; ++k) {                                                              \
      const float xi = LOAD(x[rows[k] * x_stride + i]);                                            \
      float* hk = h + k * width;                                                                   \
      _Pragma("omp simd")                                                                          \
      for (int64_t w = 0; w < width; ++w) hk[w] += xi * ar[w];                                     \
    }                                                                                              \
  }                                                                                                \
}

/* y_k[j] = round(y_k[j] + sum_r h_k[r] * b[r * size + j]) for j < size and the n tokens k of a tile
   (y_k: row rows[k] of y from column `col`, h_k: h + k * width): the expand @ B^T of one shard,
   summed in float32 and added to y once (as torch adds a float32 delta to the output). */
#define DEFINE_EXPAND(NAME, T, LOAD, STORE)                                                        \
static inline void NAME(const float* h, int64_t width, int64_t rank, const float* b, int64_t size, \
                        T* y, int64_t y_stride, const int64_t* rows, int64_t n, int64_t col) {     \
  for (int64_t j0 = 0; j0 < size; j0 += EXPAND_COLS) {                                             \
    const int64_t m = size - j0 < EXPAND_COLS ? size - j0 : EXPAND_COLS;                           \
    float acc[TILE][EXPAND_COLS] = {{0.f}};                                                        \
    for (int64_t r = 0; r < rank; ++r) {                                                           \
      const float* br = b + r * size + j0;                                                         \
      for (int64_t k = 0; k < n; ++k) {                                                            \
        const float hr = h[k * width + r];                                                         \
        _Pragma("omp simd")                                                                        \
        for (int64_t j = 0; j < m; ++j) acc[k][j] += hr * br[j];                                   \
      }                                                                                            \
    }                                                                                              \
    for (int64_t k = 0; k < n; ++k) {                                                              \
      T* yk = y + rows[k] * y_stride + col + j0;                                                   \
      for (int64_t j = 0; j < m; ++j) yk[j] = STORE(LOAD(yk[j]) + acc[k][j]);                      \
    }                                                                                              \
  }                                                                                                \
}

/* x: [tokens, in] (row stride x_stride elements, unit stride within a row), XT; y: [tokens, out]
   (row stride y_stride), YT, updated in place; order: the `count` adapter tokens (rows of x and y),
   those of one adapter next to each other; slots: each token's slot (read at the tokens of
   order; rows not in order are not touched); a: float32 [slots, in, shards * rank] (A^T of every
   shard side by side); b[s]: float32 [slots, rank, sizes[s]] (B^T of shard s, whose columns follow
   shard s - 1's in y). For every token t of order, slot l = slots[t], and shard s:
   y[t, shard s] += (x[t] @ a[l])[s * rank : (s + 1) * rank] @ b[s][l], float32 sums. Tiles of up
   to TILE neighbours in order of one slot run in parallel when the call has enough work to pay for
   waking the other threads. */
#define DEFINE_LORA_BGMV(NAME, XT, XLOAD, YT, YLOAD, YSTORE)                                       \
DEFINE_SHRINK(NAME##_shrink, XT, XLOAD)                                                            \
DEFINE_EXPAND(NAME##_expand, YT, YLOAD, YSTORE)                                                    \
void NAME(const XT* x, int64_t x_stride, YT* y, int64_t y_stride, const int64_t* slots,           \
          const int64_t* order, int64_t count, int64_t in, const float* a, const float* const* b,   \
          const int64_t* sizes, int64_t shards, int64_t rank, int threads) {                       \
  const int64_t width = shards * rank;                                                             \
  int64_t out = 0, tiles = 0;                                                                      \
  for (int64_t s = 0; s < shards; ++s) out += sizes[s];                                            \
  int64_t starts[count + 1];                                                                       \
  for (int64_t k = 0; k < count; ++k)                                                              \
    if (k == 0 || slots[order[k]] != slots[order[k - 1]] || k - starts[tiles - 1] == TILE)          \
      starts[tiles++] = k;                                                                         \
  starts[tiles] = count;                                                                           \
  const int64_t work = count * (in * width + rank * out);                                          \
  _Pragma("omp parallel for schedule(static) if(work >= (1 << 22)) num_threads(threads)")          \
  for (int64_t tile = 0; tile < tiles; ++tile) {                                                   \
    const int64_t* rows = order + starts[tile];                                                    \
    const int64_t n = starts[tile + 1] - starts[tile], slot = slots[rows[0]];                      \
    float h[TILE * width];                                                                         \
    NAME##_shrink(x, x_stride, rows, n, in, a + slot * in * width, width, h);                      \
    for (int64_t s = 0, col = 0; s < shards; col += sizes[s++])                                    \
      NAME##_expand(h + s * rank, width, rank, b[s] + slot * rank * sizes[s], sizes[s], y,         \
                    y_stride, rows, n, col);                                                       \
  }                                                                                                \
}

DEFINE_LORA_BGMV(lora_bgmv_f32_f32, float, f32_to_f32, float, f32_to_f32, f32_to_f32)
DEFINE_LORA_BGMV(lora_bgmv_f32_bf16, float, f32_to_f32, bf16, bf16_to_f32, f32_to_bf16)
DEFINE_LORA_BGMV(lora_bgmv_bf16_f32, bf16, bf16_to_f32, float, f32_to_f32, f32_to_f32)
DEFINE_LORA_BGMV(lora_bgmv_bf16_bf16, bf16, bf16_to_f32, bf16, bf16_to_f32, f32_to_bf16)
