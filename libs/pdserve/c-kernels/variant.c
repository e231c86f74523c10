/* Which CPU class this library was compiled for (setup.py's variant name), from the compiler's
   own instruction-set macros: the tests check each library is the variant its name says. */
#include "common.h"

const char* kernels_variant(void) {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
  return "amx";
#elif defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return "avx512bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}
