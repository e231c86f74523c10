"""The kernel libraries: one per CPU class is installed, the best one this CPU runs is loaded, and it
loads with no compiler anywhere on PATH (they are built at install time, not at run time)."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

import pytest

from pdserve.layers import native

X86 = platform.machine().lower() in ("x86_64", "amd64")
ZEN3 = {"avx2", "fma", "f16c", "bmi2", "sse4_2"}  # AVX2 only: no AVX-512, no VNNI
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ZEN4 = SKYLAKE_X | {"avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_int8", "amx_bf16"}


def test_every_variant_is_installed():
    expected = set(native.VARIANTS) if X86 else {"portable"}
    assert {name for name in native.VARIANTS if native.library_path(name).exists()} == expected


@pytest.mark.parametrize(
    ("flags", "installed", "expected"),
    [
        (SAPPHIRE_RAPIDS, set(native.VARIANTS), ["amx", "avx512bf16", "avx512", "avx2", "portable"]),
        (ZEN4, set(native.VARIANTS), ["avx512bf16", "avx512", "avx2", "portable"]),
        (SKYLAKE_X, set(native.VARIANTS), ["avx512", "avx2", "portable"]),
        (ZEN3, set(native.VARIANTS), ["avx2", "portable"]),
        (ZEN3 - {"fma"}, set(native.VARIANTS), ["portable"]),  # AVX2 without FMA (no such CPU ships)
        (set(), set(native.VARIANTS), ["portable"]),
        (ZEN4, {"avx2", "portable"}, ["avx2", "portable"]),  # only what is installed
        (ZEN4, set(), []),
    ],
)
def test_choose_variants_best_first(flags, installed, expected):
    assert native.choose_variants(frozenset(flags), installed) == expected


def test_each_library_is_the_variant_its_name_says():
    """Each runnable library reports the instruction sets it was compiled with; the others (which
    this CPU cannot execute) are only opened, and hold the kernels of their class."""
    for name in native.runnable_variants():
        assert native.kernel_library(name).kernels_variant().decode() == name
    if X86:
        bf16 = ctypes.CDLL(str(native.library_path("avx512bf16")))
        assert hasattr(bf16, "gemm_bf16") and hasattr(bf16, "decode_attention")
        amx = ctypes.CDLL(str(native.library_path("amx")))
        assert hasattr(amx, "amx_w4a8_panels") and not hasattr(bf16, "amx_w4a8_panels")


def test_amx_runs_where_the_cpu_has_it_and_linux_grants_the_tiles():
    """The amx variant is runnable exactly where the CPU lists AMX and Linux gives this process the
    tile state (the library asks for it when it loads; a refusal drops the variant)."""
    if not {"amx_tile", "amx_int8", "amx_bf16"} <= native._cpu_flags():
        assert "amx" not in native.runnable_variants()
        return
    granted = ctypes.CDLL(str(native.library_path("amx"))).amx_enable() == 0
    assert ("amx" in native.runnable_variants()) == granted


def test_selected_variant_is_the_best_runnable_one():
    assert native.selected_variant() == native.runnable_variants()[0]
    with native.forced_variant("portable"):
        assert native.selected_variant() == "portable"
    assert native.selected_variant() == native.runnable_variants()[0]


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter whose PATH holds no directory with a C compiler."""
    clean = {k: v for k, v in os.environ.items() if k not in ("CC", "PDSERVE_CPU_KERNELS")}
    clean["PATH"] = os.path.dirname(sys.executable)  # the venv's bin: python, no cc / gcc
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True)


def test_kernels_load_and_run_with_no_compiler_on_path():
    code = """
import shutil, torch
from pdserve.layers import native
from pdserve.layers.cpu_fused_ops import load_fused_ops
from pdserve.layers.attention.cpu_decode_kernel import load_decode_kernel
assert all(shutil.which(cc) is None for cc in ("cc", "gcc", "clang")), "a compiler is on PATH"
x = torch.randn(3, 1000)
assert torch.equal(load_fused_ops().argmax(x), x.argmax(-1))
assert load_decode_kernel() is not None
print(native.selected_variant())
"""
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [native.runnable_variants()[0]]


def test_environment_names_the_variant_or_turns_the_kernels_off():
    code = "from pdserve.layers import native; from pdserve.layers.cpu_fused_ops import load_fused_ops; "
    code += "print(native.selected_variant(), load_fused_ops() is None)"
    assert _run(code, PDSERVE_CPU_KERNELS="portable").stdout.split() == ["portable", "False"]
    assert _run(code, PDSERVE_CPU_KERNELS="none").stdout.split() == ["None", "True"]
    refused = _run(code, PDSERVE_CPU_KERNELS="avx9000")
    assert refused.returncode != 0 and "PDSERVE_CPU_KERNELS='avx9000'" in refused.stderr


def test_a_named_variant_makes_cpu_decisions_as_on_its_class():
    """``PDSERVE_CPU_KERNELS=avx2`` on any CPU: ``cpu_has`` sees no AVX-512 (so ``--dtype auto`` is
    float32 and ``--quantization auto`` is w4a8, as on an AVX2-only CPU); ``portable``: not even AVX2."""
    code = "from pdserve.layers import native; from pdserve.engine.model_config import resolve_dtype; "
    code += "print(native.cpu_has('avx512f'), native.cpu_has('avx2'), native.cpu_has('sse4_2'), "
    code += "resolve_dtype('auto', 'cpu'))"
    capped = [("avx2", "False True"), ("portable", "False False")]
    if "avx512" in native.runnable_variants():
        capped.append(("avx512", "True True"))
    for variant, expected in capped:
        if variant in native.runnable_variants():
            out = _run(code, PDSERVE_CPU_KERNELS=variant)
            assert out.stdout.split() == [*expected.split(), "True", "torch.float32"], out.stderr
    if native.cpu_has("avx512_bf16"):
        assert _run(code).stdout.split()[-1] == "torch.bfloat16"
