"""Build hook: the CPU kernels (``libs/pdserve/c-kernels/*.c``), one shared library per CPU class.

Each variant compiles every C source with the instruction sets of one class of x86-64 CPU (never
``-march=native``), so one install runs on any x86-64 and ``pdserve.layers.native`` loads the best
variant the CPU it runs on supports; on other architectures only the portable variant is built.
They are built like extension modules (so wheels, ``pip install`` and editable installs place
them in the package), but hold no Python code: ``pdserve.layers.native`` loads them with ctypes.
``-ffast-math`` is a compile flag only: linking with it would add GCC's crtfastmath startup code,
which turns on flush-to-zero in whichever thread loads the library.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = Path("libs/pdserve/c-kernels")
FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-std=c11", "-fno-semantic-interposition", "-Wno-unused-function"]
AVX2 = ["-mavx2", "-mfma", "-mf16c", "-mbmi2"]
AVX512 = [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
# name -> compiler flags; pdserve.layers.native.VARIANTS lists the CPU flags each one needs
AVX512BF16 = [*AVX512, "-mavx512bf16", "-mavx512vnni"]
VARIANTS = {
    "amx": [*AVX512BF16, "-mamx-tile", "-mamx-int8", "-mamx-bf16"],
    "avx512bf16": AVX512BF16,
    "avx512": AVX512,
    "avx2": AVX2,
    "portable": [],
}
X86 = platform.machine().lower() in ("x86_64", "amd64")


def kernel_library(name: str, flags: list[str]) -> Extension:
    return Extension(
        f"pdserve._kernels_{name}",
        sources=sorted(str(path) for path in CSRC.glob("*.c")),
        depends=sorted(str(path) for path in CSRC.glob("*.h")),
        extra_compile_args=[*FLAGS, *flags],
        extra_link_args=["-fopenmp"],
        libraries=["m"],  # with libmvec, the vectorised expf that -ffast-math loops call
    )


class BuildKernels(build_ext):
    """Each variant's objects in a directory of their own (the variants compile the same sources)."""

    def build_extension(self, ext: Extension) -> None:
        temp, self.build_temp = self.build_temp, os.path.join(self.build_temp, ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = temp


setup(
    ext_modules=[kernel_library(name, flags) for name, flags in VARIANTS.items() if X86 or not flags],
    cmdclass={"build_ext": BuildKernels},
)
