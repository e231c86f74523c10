"""Batch invariance through real stacks in the default configuration (``--dtype auto --quantization
auto``): a request's greedy tokens and logprobs over HTTP are the same bit for bit sent alone, sent
among 15 other requests of other lengths, sent again (a radix-cache hit), and colocated or
disaggregated (its prompt prefilled by another process, its KV shipped over NIXL).
``tests/scheduler/test_batch_invariance.py`` checks more conditions in process, bfloat16 too."""

from __future__ import annotations

import pytest

from tests.batch_invariance import PROBES, assert_invariant, generate
from tests.stack import Stack, launch_stack

DEFAULTS = ("--max-total-tokens", "16384")  # no --dtype / --quantization: the CPU's defaults


@pytest.fixture(scope="module")
def stacks() -> dict[str, Stack]:
    launched = {
        "colocated": launch_stack("--colocated", *DEFAULTS, log_name="invariance-colocated"),
        "pd": launch_stack("--num-prefill", "1", "--num-decode", "1", *DEFAULTS, log_name="invariance-pd"),
    }
    yield launched
    for stack in launched.values():
        stack.stop()


def test_greedy_outputs_and_logprobs_are_the_same_alone_batched_cached_colocated_and_pd(stacks):
    alone = {q: generate(stacks["colocated"], q) for q in PROBES}
    for stack in stacks.values():  # the PD stack against the colocated one's outputs too
        assert_invariant(stack, alone)
