"""``SchedulerLoop`` on an asyncio loop with the real model: the step-input seam (inputs applied in
arrival order at one point per iteration) and the overlapped loop's outputs."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.model_runner import ModelRunner
from pdserve.scheduler.req import FinishReason
from pdserve.scheduler.scheduler import StepOutput
from pdserve.services.common.scheduler_loop import SchedulerLoop
from tests.reference import hf_greedy
from tests.scheduler.driver import fresh, ids, make_runner, req


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_runner(4096)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
async def test_inputs_apply_in_arrival_order_and_outputs_match_the_reference(runner, overlap):
    sched = fresh(runner, role="mixed")
    outputs: list[StepOutput] = []
    loop = SchedulerLoop(sched, outputs.extend, overlap=overlap)
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    try:
        with pytest.raises(ValueError, match="empty"):
            await loop.add(req("bad", []))
        prompt = ids("The capital of France is")
        first = loop.add(req("a", prompt, max_new=8))
        loop.add(req("b", ids("Hi"), max_new=50))
        loop.abort("b", "changed my mind")  # after its add, in the same step: it never runs
        assert await first == 1
        while not {"a", "b"} <= {o.req.rid for o in outputs if o.finished}:
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await task
    tokens = [t for o in outputs if o.req.rid == "a" for t in o.new_token_ids]
    assert tokens == hf_greedy(prompt, 8)
    [b] = [o for o in outputs if o.req.rid == "b"]
    assert b.finished and b.new_token_ids == [] and b.req.finish_reason is FinishReason.ABORT
    assert not sched.has_work() and sched.ledger.used_pages() == 0
    sched.check_invariants()
