"""Batch invariance of the CPU kernels, bit for bit: a row's result never depends on the other rows of
the call, their number, its own place among them, or the number of threads, on every kernel variant
this CPU runs. (The engine-level checks, a request alone or in a batch, are test_batch_invariance.py.)

Each kernel fixes the order of its reductions by the shape alone: matmuls sum K in the same order
for every row (no split-K, one kernel family for every M, panels split across threads), the W4A8
AMX tiles (``amx`` variant, from 16 rows on) give the vector kernel's integer group sums and run
its float epilogue, and the row-wise fused ops reduce one row at a time.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.layers.cpu_fused_ops import load_fused_ops
from pdserve.layers.cpu_gemm import load_cpu_gemm
from pdserve.layers.cpu_matmul import FORMATS, NIBBLE_PLANES, load_cpu_matmul
from pdserve.layers.native import forced_variant, runnable_variants

ROWS = 150
SIZES = [1, 2, 7, 8, 15, 16, 17, 33, 64, 65, 150]  # around the register tiles, AMX tiles and row blocks


def subsets(seed: int) -> list[torch.Tensor]:
    """For each size, that many distinct rows of ``ROWS`` in a random order."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randperm(ROWS, generator=gen)[:m] for m in SIZES]


def assert_rows_invariant(run, x: torch.Tensor, seed: int) -> None:
    """``run(rows)`` on every subset of ``x``'s rows (one thread) gives those rows of ``run(x)``
    (two threads), bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        full = run(x)
        torch.set_num_threads(1)
        for rows in subsets(seed):
            assert torch.equal(run(x[rows]), full[rows]), f"{len(rows)} rows"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("format", [*FORMATS, "w8a8", *NIBBLE_PLANES])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_matmul_rows_are_batch_invariant(kernel_variant, format, x_dtype):
    gen = torch.Generator().manual_seed(len(format))
    weight = torch.randn(192, 576, generator=gen) * 0.05
    bias = torch.randn(192, generator=gen)
    x = torch.randn(ROWS, 576, generator=gen).to(x_dtype)
    packed = load_cpu_matmul().pack(weight, format)
    assert_rows_invariant(lambda rows: packed.matmul(rows, bias, torch.float32), x, seed=1)
    halves = packed.to_halves()
    assert_rows_invariant(lambda rows: halves.silu_and_mul(rows, bias), x, seed=2)


@pytest.mark.parametrize("variant", [v for v in runnable_variants() if v in ("amx", "avx512bf16")])
def test_panel_gemm_rows_are_batch_invariant(variant):
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(192, 576, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(192, generator=gen).bfloat16()
    x = torch.randn(ROWS, 576, generator=gen).bfloat16()
    with forced_variant(variant):
        packed = load_cpu_gemm().pack(weight)
        assert_rows_invariant(lambda rows: packed.matmul(rows, bias, torch.float32), x, seed=4)
        halves = packed.to_halves()
        assert_rows_invariant(lambda rows: halves.silu_and_mul(rows, bias), x, seed=5)


@pytest.mark.skipif("amx" not in runnable_variants(), reason="this CPU has no AMX tiles")
@pytest.mark.parametrize("format", list(NIBBLE_PLANES))
def test_w4a8_tiles_give_the_vector_kernels_results(format):
    """The amx variant runs W4A8 on AMX tiles from 16 rows on: the same integer sums per group as
    VPDPBUSD and the same float epilogue, so every row equals the avx512bf16 variant's, bit for bit."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(96, 1536, generator=gen) * 0.05
    x = torch.randn(ROWS, 1536, generator=gen).bfloat16()
    out = {}
    for variant in ("amx", "avx512bf16"):
        with forced_variant(variant):
            packed = load_cpu_matmul().pack(weight, format)
            out[variant] = [packed.matmul(x[rows], None, torch.float32) for rows in subsets(7)]
    for amx, vnni in zip(out["amx"], out["avx512bf16"], strict=True):
        assert torch.equal(amx, vnni), f"{len(amx)} rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_row_ops_are_batch_invariant(kernel_variant, dtype):
    """add + RMSNorm (the normalised row and the updated residual) and argmax: one row at a time."""
    ops = load_fused_ops()
    gen = torch.Generator().manual_seed(8)
    pairs = torch.randn(ROWS, 2, 576, generator=gen).to(dtype)  # each row's input and its residual
    weight = torch.randn(576, generator=gen).to(dtype)

    def add_rmsnorm(rows: torch.Tensor) -> torch.Tensor:
        residual = rows[:, 1].contiguous()
        return torch.stack([ops.add_rmsnorm(rows[:, 0].contiguous(), residual, weight, 1e-5), residual], 1)

    assert_rows_invariant(add_rmsnorm, pairs, seed=9)
    assert_rows_invariant(lambda rows: ops.argmax(rows[:, 0].contiguous()), pairs, seed=10)
