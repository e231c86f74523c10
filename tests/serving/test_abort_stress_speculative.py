"""The abort stress of ``test_abort_stress`` on a PD stack whose decode workers speculate (n-gram
drafts): requests abandoned at random times leave no KV page used on any scheduler.

A loop iteration that ran a speculative step does not yield to other tasks before the next step's
inputs, so an abort there cancels the prefill task of a request admitted that step before it ever
ran; its pages, held while a prefill worker might write them, stayed held for ever until
``KVDrained`` came from the task's done callback rather than its body (before the fix, ``always``
left 1 to 4 pages used on an idle decode worker in each of 3 runs; ``adaptive``, which speculates
in fewer steps, passed its one run)."""

from __future__ import annotations

import pytest

from tests.conftest import COMMON
from tests.serving.test_abort_stress import abort_stress
from tests.stack import Stack, launch_stack


@pytest.fixture(scope="module", params=["adaptive", "always"])
def spec_pd_stack(request) -> Stack:
    stack = launch_stack(
        "--num-prefill", "1", "--num-decode", "2", *COMMON,
        "--speculative-algorithm", "ngram", "--speculative-policy", request.param,
        log_name=f"abort-spec-{request.param}",
    )  # fmt: skip
    yield stack
    stack.stop()


def test_aborts_while_speculating_leak_no_kv_page(spec_pd_stack):
    abort_stress(spec_pd_stack)
