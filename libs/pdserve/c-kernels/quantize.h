/* Symmetric per-row int8 quantization of activations, shared by the fused op that exposes it
   (quantize_rows) and the W8A8 matmul that does it internally, so both give the same integers:
   scale = max|x| / 127, q = round-half-even(x * (127 / max|x|)) (all 0 for a zero row). */
#ifndef PDSERVE_QUANTIZE_H
#define PDSERVE_QUANTIZE_H

#include "common.h"

INLINE float quantize_inverse(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }
INLINE int quantize_value(float x, float inverse) { return (int)nearbyintf(x * inverse); }

/* q[i] (int16) for the n values of x; returns the row's scale. */
#define DEFINE_QUANTIZE_ROW(NAME, T, LOAD)                                              \
  static inline float NAME(const T* x, int64_t n, int16_t* q) {                         \
    float amax = 0.f;                                                                   \
    for (int64_t i = 0; i < n; ++i) amax = fmaxf(amax, fabsf(LOAD(x[i])));              \
    const float inverse = quantize_inverse(amax);                                       \
    for (int64_t i = 0; i < n; ++i) q[i] = (int16_t)quantize_value(LOAD(x[i]), inverse); \
    return amax / 127.f;                                                                \
  }
DEFINE_QUANTIZE_ROW(quantize_row_f32, float, f32_to_f32)
DEFINE_QUANTIZE_ROW(quantize_row_bf16, bf16, bf16_to_f32)

#endif
