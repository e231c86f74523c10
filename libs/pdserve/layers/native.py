"""Build small C kernels with the system C compiler on first use, and load them with ctypes.

A shared library is cached under ``$PDSERVE_CACHE_DIR/kernels`` keyed by its source, the flags,
the compiler and the CPU's flags (``-march=native``), so each machine builds each source once;
concurrent builders each install a complete file atomically. Without a working C compiler
``build_library`` returns None and callers fall back to PyTorch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve.model_source import cache_dir

logger = logging.getLogger(__name__)

# -ffast-math lets reductions and exponentials vectorise (kernels here never see inf/NaN by design).
# It is a compile flag only: linking with it would add GCC's crtfastmath startup code, which turns
# on flush-to-zero in whichever thread loads the library.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
LINK_FLAGS = ("-shared", "-fopenmp")


# e^x lane-wise for AVX-512 sources (inside their ``#ifdef __AVX512F__``, after <immintrin.h>): x
# clamped to [-88, 88] (e^-88 gives 0), 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, ln 2
# in two parts and a degree-6 Taylor polynomial; relative error below 3e-7.
AVX512_EXP = r"""
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
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
"""


# bfloat16 <-> float32 lanes and the SwiGLU gate for AVX-512 sources (after AVX512_EXP): 16 values
# widened exactly, rounded to nearest-even, and silu(gate) * up rounded where Hugging Face's
# bfloat16 modules round (silu(gate), then the product; exp512 for the sigmoid instead of libm's
# expf: the two differ below 3e-7 relative, which moves a result only when it lies that close to
# a rounding boundary).
AVX512_BF16 = r"""
static inline __m512 bf16_to_f32_16(__m256i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
static inline __m512 load16_bf16(const uint16_t* x) {
  return bf16_to_f32_16(_mm256_loadu_si256((const void*)x));
}
static inline __m256i round16_bf16(__m512 x) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(x);  /* the same rounding in one instruction */
#else
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}
static inline __m256i silu_mul16_bf16(__m512 gate, __m512 up) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate));
  const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return round16_bf16(_mm512_mul_ps(bf16_to_f32_16(round16_bf16(silu)), up));
}
"""


def build_library(name: str, source: str) -> ctypes.CDLL | None:
    """Compile ``source`` (C11, OpenMP) into ``<name>-<hash>.so`` once, and load it.

    Returns None (and logs why) when no C compiler is found or the build fails.
    """
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("no C compiler found: %s falls back to PyTorch ops", name)
        return None
    key = hashlib.sha1("\n".join([source, *FLAGS, *LINK_FLAGS, compiler, _cpu_flags()]).encode()).hexdigest()[
        :16
    ]
    path = cache_dir() / "kernels" / f"{name}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            src, obj, built = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.o", Path(tmp) / "lib.so"
            src.write_text(source)
            run = subprocess.run(
                [compiler, *FLAGS, "-c", str(src), "-o", str(obj)], capture_output=True, text=True
            )
            if run.returncode == 0:
                link = [compiler, *LINK_FLAGS, str(obj), "-o", str(built), "-lm"]
                run = subprocess.run(link, capture_output=True, text=True)
            if run.returncode != 0:
                logger.warning("building %s failed, using PyTorch ops:\n%s", name, run.stderr)
                return None
            built.replace(path)
    return ctypes.CDLL(str(path))


@functools.cache
def _cpu_flags() -> str:
    try:
        return next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return ""


def cpu_has(*flags: str) -> bool:
    """True when ``/proc/cpuinfo`` lists any of ``flags`` (e.g. ``"avx512_vnni"``, ``"avx_vnni"``)."""
    have = set(_cpu_flags().split())
    return any(flag in have for flag in flags)
