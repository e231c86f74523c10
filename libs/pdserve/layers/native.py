"""The CPU kernels' shared library: the variant built for this CPU's class, loaded with ctypes.

The C sources (``pdserve/c-kernels``) are compiled at install time (``setup.py``) once per class of
x86-64 CPU: ``amx`` (``avx512bf16`` plus AMX tiles), ``avx512bf16`` (AVX-512 with BF16 and VNNI),
``avx512``, ``avx2`` (AVX2 + FMA + F16C) and ``portable`` (no instruction set beyond the
baseline). At run time ``kernel_library`` loads the best one the CPU supports (``/proc/cpuinfo``;
``amx`` also needs Linux to grant the process the tile state), so no compiler is needed where
pdserve runs.
``PDSERVE_CPU_KERNELS`` names another variant (or ``none``: PyTorch ops only); ``forced_variant``
switches it within a process (the tests run every variant the machine can execute).

A variant named in ``PDSERVE_CPU_KERNELS`` also caps what ``cpu_has`` reports to that class, so
every CPU-feature decision (``--dtype auto``, ``--quantization auto``) is made as on such a CPU:
``PDSERVE_CPU_KERNELS=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX-512 machine
runs pdserve (and PyTorch's own kernels) as an AVX2-only CPU would (``make bench-llama ARGS=
"--cpu-class avx2"``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.machinery
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

# Best first: each variant and the /proc/cpuinfo flags a CPU needs to run it (setup.py's compiler flags).
_AVX2 = ("avx2", "fma", "f16c", "bmi2")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq")
_AVX512BF16 = (*_AVX512, "avx512_bf16", "avx512_vnni")
VARIANTS: dict[str, tuple[str, ...]] = {
    "amx": (*_AVX512BF16, "amx_tile", "amx_int8", "amx_bf16"),
    "avx512bf16": _AVX512BF16,
    "avx512": _AVX512,
    "avx2": _AVX2,
    "portable": (),
}
_CLASS_FLAGS = frozenset(flag for needs in VARIANTS.values() for flag in needs)
_ENV = "PDSERVE_CPU_KERNELS"
T = TypeVar("T")
_forced: list[str | None] = [None]


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def _is_isa_extension(flag: str) -> bool:
    """An instruction-set flag that tells CPU classes apart (one a variant's class may lack)."""
    return flag in _CLASS_FLAGS or flag.startswith(("avx512", "amx", "avx_vnni"))


@functools.cache
def _visible_flags(requested: str) -> frozenset[str]:
    flags = _cpu_flags()
    if requested not in VARIANTS:  # auto / none / an unknown name (refused by selected_variant)
        return flags
    return frozenset(f for f in flags if not _is_isa_extension(f) or f in VARIANTS[requested])


def cpu_has(*flags: str) -> bool:
    """True when ``/proc/cpuinfo`` lists any of ``flags`` (e.g. ``"avx512_vnni"``, ``"avx_vnni"``);
    with ``$PDSERVE_CPU_KERNELS`` naming a variant, only the instruction sets of that variant's
    class count (``avx2``: no ``avx512_*``, ``amx_*`` or ``avx_vnni``)."""
    visible = _visible_flags(os.environ.get(_ENV, "auto"))
    return any(flag in visible for flag in flags)


def cpu_description() -> str:
    """The CPU's model name, core count and the kernel variant in use, for benchmark tables
    (e.g. ``AMD EPYC, 2 cores, kernels avx2``)."""
    name = "unknown CPU"
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), name)
    return f"{name}, {os.cpu_count()} cores, kernels {selected_variant() or 'off'}"


def library_path(variant: str) -> Path:
    """Where the installed library of ``variant`` is (it may be absent: not built on this machine)."""
    return Path(__file__).parent.parent / f"_kernels_{variant}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def choose_variants(cpu_flags: set[str] | frozenset[str], installed: set[str]) -> list[str]:
    """Of the ``installed`` variants, those a CPU with ``cpu_flags`` can execute, best first."""
    return [name for name, needs in VARIANTS.items() if set(needs) <= cpu_flags and name in installed]


def runnable_variants() -> list[str]:
    """The installed variants this CPU can execute, best first (``amx`` only where Linux grants this
    process the tile state: ``arch_prctl(ARCH_REQ_XCOMP_PERM)``, kernel 5.16 or later)."""
    return list(_runnable())


@functools.cache
def _runnable() -> tuple[str, ...]:
    installed = {name for name in VARIANTS if library_path(name).exists()}
    runnable = choose_variants(_cpu_flags(), installed)
    if "amx" in runnable:
        try:
            kernel_library("amx")
        except OSError as refused:
            logger.warning("%s: the avx512bf16 kernels run instead", refused)
            runnable.remove("amx")
    return tuple(runnable)


def selected_variant() -> str | None:
    """The variant the kernels load: ``forced_variant``'s, else ``$PDSERVE_CPU_KERNELS``, else the
    best runnable one; None for ``none`` (PyTorch ops only) or when none is installed.

    Raises:
        ValueError: ``$PDSERVE_CPU_KERNELS`` names an unknown variant or one this CPU cannot run.
    """
    if _forced[0] is not None:
        return _forced[0]
    return _default_variant()


@functools.cache
def _default_variant() -> str | None:
    requested, runnable = os.environ.get(_ENV, "auto"), runnable_variants()
    if requested == "none":
        return None
    if requested == "auto":
        if not runnable:
            logger.warning("no CPU kernel library is installed (rebuild pdserve): PyTorch ops only")
        return runnable[0] if runnable else None
    if requested not in runnable:
        raise ValueError(f"{_ENV}={requested!r}: choose auto, none or one of {runnable} (runnable here)")
    return requested


@contextlib.contextmanager
def forced_variant(variant: str) -> Iterator[None]:
    """Within the block every kernel loader returns ``variant``'s kernels (one of ``runnable_variants``)."""
    previous, _forced[0] = _forced[0], variant
    try:
        yield
    finally:
        _forced[0] = previous


@functools.cache
def kernel_library(variant: str) -> ctypes.CDLL:
    """The loaded library of ``variant`` (one of ``runnable_variants()``).

    Raises:
        OSError: it is not installed or does not load, or (``amx``) Linux refuses this process the
            tile state.
    """
    lib = ctypes.CDLL(str(library_path(variant)))
    lib.kernels_variant.restype = ctypes.c_char_p
    if variant == "amx" and lib.amx_enable() != 0:
        raise OSError("Linux refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
    return lib


def per_variant(make: Callable[[str], T | None]) -> Callable[[], T | None]:
    """Decorator: ``make(variant)`` builds a kernel wrapper from ``kernel_library(variant)`` (or None
    where that variant lacks the kernel); the decorated function takes no arguments and returns the
    selected variant's wrapper, made once per variant (None when the kernels are off)."""
    made = functools.cache(make)

    @functools.wraps(make)
    def load() -> T | None:
        variant = selected_variant()
        return None if variant is None else made(variant)

    return load
