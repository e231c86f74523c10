/* What every kernel source shares: scalar bfloat16 conversions, a branch-free exponential, and the
   vector forms of both for the instruction sets a variant is compiled for (setup.py compiles each
   source once per CPU class: AVX-512 with BF16/VNNI, AVX-512, AVX2 + FMA, portable; the macros
   __AVX512F__, __AVX512BF16__, __AVX2__, ... say which one is being compiled). */
#ifndef PDSERVE_COMMON_H
#define PDSERVE_COMMON_H

#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))
typedef uint16_t bf16;

/* A parallel region's body, run by thread t of nt. */
typedef void (*ThreadBody)(const void* ctx, int t, int nt);

/* body(ctx, t, nt) on `threads` OpenMP threads, or with one thread called directly: with libgomp
   opening a region costs ~1.5 us even for a team of one (a new team, its work share and barrier),
   and moe.c runs each active expert's two matmuls on one thread from its own region, so at a
   decode step's ~100 active experts a layer that was more than the experts' arithmetic. A body
   holds no worksharing construct, and a barrier only where nt > 1 (called directly inside
   another region, an orphaned one would bind to that region's team). */
static inline void run_threads(int threads, ThreadBody body, const void* ctx) {
  if (threads <= 1) {
    body(ctx, 0, 1);
    return;
  }
  #pragma omp parallel num_threads(threads)
  body(ctx, omp_get_thread_num(), omp_get_num_threads());
}

INLINE float bf16_to_f32(bf16 x) {
  uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
INLINE bf16 f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
  return (bf16)(u >> 16);
}
INLINE float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
INLINE float f32_to_f32(float x) { return x; }

/* IEEE half precision (the scales of grouped quantized weights, as GGUF stores them) to float32. */
typedef uint16_t f16;
INLINE float f16_to_f32(f16 h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 31u, man = h & 1023u;
  uint32_t bits = sign | ((exp + 112u) << 23) | (man << 13);    /* normal */
  if (exp == 31) bits = sign | 0x7F800000u | (man << 13);        /* inf, NaN */
  float f;
  if (exp == 0) {                                                /* zero, subnormal: man * 2^-24 */
    f = (float)man * (1.f / 16777216.f);
    return sign ? -f : f;
  }
  memcpy(&f, &bits, 4);
  return f;
#endif
}

/* e^x for x <= 0 (relative error below 3e-7; 0 from x = -88 down): 2^n * e^r with n = round(x /
   ln 2), |r| <= ln(2) / 2, ln 2 in two parts (n * hi is exact) and a degree-6 Taylor polynomial.
   Branch-free, so loops over it vectorise. */
INLINE float exp_nonpositive(float x) {
  x = x > -88.f ? x : -88.f;
  const float n = rintf(x * 1.44269504f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r / 720)))));
  const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n; n = -127 gives the bits of 0.f */
  float two_n;
  memcpy(&two_n, &bits, 4);
  return p * two_n;
}

#ifdef __AVX512F__
/* e^x lane-wise, x clamped to [-88, 88]: the same method as exp_nonpositive. */
INLINE __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i biased = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(biased, 23)));
}

/* 16 bfloat16 widened exactly, and 16 float32 rounded to nearest-even bfloat16. */
INLINE __m512 bf16_to_f32_16(__m256i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
INLINE __m512 load16_bf16(const bf16* x) { return bf16_to_f32_16(_mm256_loadu_si256((const void*)x)); }
INLINE __m256i round16_bf16(__m512 x) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(x); /* the same rounding in one instruction */
#else
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

/* silu(gate) * up rounded where Hugging Face's bfloat16 modules round (silu(gate), then the
   product); exp512 for the sigmoid instead of libm's expf: the two differ below 3e-7 relative. */
INLINE __m256i silu_mul16_bf16(__m512 gate, __m512 up) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate));
  const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return round16_bf16(_mm512_mul_ps(bf16_to_f32_16(round16_bf16(silu)), up));
}
#endif

#ifdef __AVX2__
/* The 8-lane forms for AVX2 + FMA: e^x, bfloat16 widening and rounding, silu(gate) * up. */
INLINE __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}

INLINE __m256 bf16_to_f32_8(__m128i x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
INLINE __m256 load8_bf16(const bf16* x) { return bf16_to_f32_8(_mm_loadu_si128((const void*)x)); }
INLINE __m256 load8_f16(const f16* x) { return _mm256_cvtph_ps(_mm_loadu_si128((const void*)x)); }
INLINE __m128i round8_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  /* packus on 128-bit halves: lanes 0-3 and 4-7 of r land in the low 64 bits of each half */
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
INLINE void store8_bf16(bf16* out, __m256 x) { _mm_storeu_si128((void*)out, round8_bf16(x)); }

INLINE __m256 silu256(__m256 gate) {
  const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gate));
  return _mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}

/* The total of the 8 lanes. */
INLINE float hsum256(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#endif
