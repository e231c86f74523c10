/* The mixed-adapter LoRA delta of one linear layer (see pdserve/lora/bgmv.py), BGMV-style (Punica's
   batched gather matrix-vector product, Chen et al. 2023): every token gathers its own adapter's
   low-rank weights, so a batch of any mix of adapters is one call, with no grouping by adapter. */
#include "common.h"

#define EXPAND_COLS 64 /* output columns summed in one block of float32 accumulators */

/* h[w] = sum_i x[i] * a[i * width + w] for w < width: the shrink x @ A^T of one token. */
#define DEFINE_SHRINK(NAME, T, LOAD)                                                               \
static inline void NAME(const T* x, int64_t in, const float* a, int64_t width, float* h) {        \
  for (int64_t w = 0; w < width; ++w) h[w] = 0.f;                                                  \
  for (int64_t i = 0; i < in; ++i) {                                                               \
    const float xi = LOAD(x[i]);                                                                   \
    const float* ar = a + i * width;                                                               \
    _Pragma("omp simd")                                                                            \
    for (int64_t w = 0; w < width; ++w) h[w] += xi * ar[w];                                        \
  }                                                                                                \
}

/* y[j] = round(y[j] + sum_r h[r] * b[r * size + j]) for j < size: the expand @ B^T of one token and
   shard, summed in float32 and added to y once (as torch adds a float32 delta to the output). */
#define DEFINE_EXPAND(NAME, T, LOAD, STORE)                                                        \
static inline void NAME(const float* h, int64_t rank, const float* b, int64_t size, T* y) {       \
  for (int64_t j0 = 0; j0 < size; j0 += EXPAND_COLS) {                                             \
    const int64_t n = size - j0 < EXPAND_COLS ? size - j0 : EXPAND_COLS;                           \
    float acc[EXPAND_COLS] = {0.f};                                                                \
    for (int64_t r = 0; r < rank; ++r) {                                                           \
      const float hr = h[r];                                                                       \
      const float* br = b + r * size + j0;                                                         \
      _Pragma("omp simd")                                                                          \
      for (int64_t j = 0; j < n; ++j) acc[j] += hr * br[j];                                        \
    }                                                                                              \
    for (int64_t j = 0; j < n; ++j) y[j0 + j] = STORE(LOAD(y[j0 + j]) + acc[j]);                   \
  }                                                                                                \
}

/* x: [tokens, in] (row stride x_stride elements, unit stride within a row), XT; y: [tokens, out]
   (row stride y_stride), YT, updated in place; token_slots: [tokens], -1 for a token without an
   adapter (its row of y is not touched), else < the slots of a and b; a: float32 [slots, in,
   shards * rank] (A^T of every shard side by side); b[s]: float32 [slots, rank, sizes[s]] (B^T of
   shard s, whose columns follow shard s - 1's in y). For every adapter token t of slot l and
   shard s: y[t, shard s] += (x[t] @ a[l])[s * rank : (s + 1) * rank] @ b[s][l], float32 sums.
   Tokens run in parallel when the call has enough work to pay for waking the other threads. */
#define DEFINE_LORA_BGMV(NAME, XT, XLOAD, YT, YLOAD, YSTORE)                                       \
DEFINE_SHRINK(NAME##_shrink, XT, XLOAD)                                                            \
DEFINE_EXPAND(NAME##_expand, YT, YLOAD, YSTORE)                                                    \
void NAME(const XT* x, int64_t x_stride, YT* y, int64_t y_stride, const int64_t* token_slots,     \
          int64_t tokens, int64_t in, const float* a, const float* const* b, const int64_t* sizes,  \
          int64_t shards, int64_t rank, int threads) {                                             \
  const int64_t width = shards * rank;                                                             \
  int64_t out = 0;                                                                                 \
  for (int64_t s = 0; s < shards; ++s) out += sizes[s];                                            \
  const int64_t work = tokens * (in * width + rank * out);                                         \
  _Pragma("omp parallel for schedule(static) if(work >= (1 << 22)) num_threads(threads)")          \
  for (int64_t t = 0; t < tokens; ++t) {                                                           \
    const int64_t slot = token_slots[t];                                                           \
    if (slot < 0) continue;                                                                        \
    float h[width];                                                                                \
    NAME##_shrink(x + t * x_stride, in, a + slot * in * width, width, h);                          \
    YT* yr = y + t * y_stride;                                                                     \
    for (int64_t s = 0; s < shards; ++s) {                                                         \
      NAME##_expand(h + s * rank, rank, b[s] + slot * rank * sizes[s], sizes[s], yr);              \
      yr += sizes[s];                                                                              \
    }                                                                                              \
  }                                                                                                \
}

DEFINE_LORA_BGMV(lora_bgmv_f32_f32, float, f32_to_f32, float, f32_to_f32, f32_to_f32)
DEFINE_LORA_BGMV(lora_bgmv_f32_bf16, float, f32_to_f32, bf16, bf16_to_f32, f32_to_bf16)
DEFINE_LORA_BGMV(lora_bgmv_bf16_f32, bf16, bf16_to_f32, float, f32_to_f32, f32_to_f32)
DEFINE_LORA_BGMV(lora_bgmv_bf16_bf16, bf16, bf16_to_f32, bf16, bf16_to_f32, f32_to_bf16)
