/* The paged attention kernel's constants (the key block, the fixed key split, the mask value) and
   the AVX-512 view of bfloat16 chunks. */
#ifndef PDSERVE_ATTENTION_H
#define PDSERVE_ATTENTION_H

#include "common.h"

#define BLOCK 16          /* keys scored together: one AVX-512 vector of float32 scores */
#define SPLIT_KEYS 512    /* keys of a work item: a row's keys split at fixed positions from its first */
#define MAX_CHUNKS 16     /* AVX-512 accumulators of one head: head_dim <= 256 */
#define MASKED (-FLT_MAX) /* the score of a block's lanes past its last key */

enum { F32 = 0, BF16 = 1 };

#ifdef __AVX512F__
/* A chunk kept in a register: without the empty asm the compiler folds the load into each head's
   FMA, reading the chunk once per head after all. */
INLINE __m512i load_chunk(const char* x) {
  __m512i chunk = _mm512_loadu_si512(x);
  __asm__("" : "+v"(chunk));
  return chunk;
}

/* 32 bfloat16 read as 16 int32 lanes hold elements 2i (low half) and 2i + 1 (high half) of lane i. */
INLINE __m512 bf16_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
INLINE __m512 bf16_odd(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
}
#endif

#endif
