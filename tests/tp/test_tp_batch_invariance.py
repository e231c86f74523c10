"""Batch invariance within a tensor-parallel scheduler (``--tp-size 2``, the default dtype, which runs
unquantized under TP): a request's greedy tokens and logprobs are the same alone, among other
requests and after a radix-cache hit. Against ``--tp-size 1`` they are not bit for bit: each rank's
row-parallel matmuls (o_proj, down_proj) sum half of the inputs and the all-reduce adds the two
halves, another order of the same sums (docs/cpu.md, determinism)."""

from __future__ import annotations

import pytest

from tests.batch_invariance import PROBES, assert_invariant, generate
from tests.stack import Stack, launch_stack


@pytest.fixture(scope="module")
def tp_stack() -> Stack:
    flags = ("--colocated", "--tp-size", "2", "--max-total-tokens", "8192")
    stack = launch_stack(*flags, log_name="invariance-tp2")
    yield stack
    stack.stop()


def test_tp2_outputs_are_the_same_alone_batched_and_cached(tp_stack):
    assert_invariant(tp_stack, {q: generate(tp_stack, q) for q in PROBES})
