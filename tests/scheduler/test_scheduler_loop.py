"""``SchedulerLoop`` on an asyncio loop with the real model: the step-input seam (inputs applied in
arrival order at one point per iteration) and the overlapped loop's outputs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from pdserve.engine.model_runner import ModelRunner
from pdserve.scheduler.req import FinishReason
from pdserve.scheduler.scheduler import StepOutput
from pdserve.services.common.events import KVReady
from pdserve.services.common.scheduler_loop import SchedulerLoop
from tests.reference import hf_greedy
from tests.scheduler.driver import fresh, ids, make_runner, req


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_runner(4096)


OPENMP_THREADS_SCRIPT = """
import contextlib, json, threading, psutil, torch
from pdserve.services.common.scheduler_loop import openmp_off_this_thread

seen = {"baseline": psutil.Process().num_threads()}
def parallel_op(key, limited):
    with openmp_off_this_thread() if limited else contextlib.nullcontext():
        # as ForwardBatch.init_new: tensor repeats open a parallel region whatever the size
        torch.repeat_interleave(torch.arange(64), torch.full((64,), 128))
        seen[key] = (torch.get_num_threads(), psutil.Process().num_threads())
        if limited:
            other = threading.Thread(target=lambda: seen.update(other=torch.get_num_threads()))
            other.start(); other.join()
for key, limited in (("loop", True), ("free", False)):
    t = threading.Thread(target=parallel_op, args=(key, limited)); t.start(); t.join()
print(json.dumps(seen))
"""


def test_the_loop_thread_runs_no_openmp_team():
    """Inside ``openmp_off_this_thread`` a thread's parallel ops start no OpenMP helpers; another
    thread keeps its team, and so does a thread outside it (a fresh process, OMP_NUM_THREADS=2)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", OPENMP_THREADS_SCRIPT], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    base = seen["baseline"]
    assert seen["loop"] == [1, base + 1]  # the thread itself, no helper
    assert seen["other"] == 2
    assert seen["free"] == [2, base + 2]  # the thread and its team's one helper


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


async def test_a_request_whose_event_fails_is_failed_not_left_waiting(runner):
    """A KVReady nobody awaits (a prefill task posts it) whose handler raises (here: a malformed
    logprob, after the token was appended) fails its request with the error and frees its pages; the
    other request waiting for its KV is untouched, and lands as usual."""
    sched = fresh(runner, role="decode")
    outputs: list[StepOutput] = []
    loop = SchedulerLoop(sched, outputs.extend)
    loop.handlers[KVReady] = lambda e: sched.kv_ready(e.rid, e.first_token_id, e.logprob)
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    try:
        await loop.add(req("bad", ids("The capital of France is"), max_new=4))
        await loop.add(req("good", ids("Hi"), max_new=1))
        while sched.waiting_for_kv("good") is None or sched.waiting_for_kv("bad") is None:
            await asyncio.sleep(0.01)
        loop.submit(KVReady("bad", 11, logprob=(-0.5,), cached_tokens=0, transferred_bytes=0))
        loop.submit(KVReady("good", 12, logprob=None, cached_tokens=0, transferred_bytes=0))
        while not {"bad", "good"} <= {o.req.rid for o in outputs if o.finished}:
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await task
    [bad] = [o.req for o in outputs if o.req.rid == "bad" and o.finished]
    assert bad.finish_reason is FinishReason.ERROR
    assert bad.error.startswith("internal error applying KVReady: IndexError")
    [good] = [o.req for o in outputs if o.req.rid == "good" and o.finished]
    assert (good.finish_reason, good.output_ids) == (FinishReason.LENGTH, [12])
    assert not sched.has_work() and sched.ledger.used_pages() == 0
    sched.check_invariants()
