"""Overload limits of the scheduler core on the real model: the waiting-queue bound (sized from the
KV pool), the queue-time limit, and that the requests that do run keep their exact outputs."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.model_source import resolve_model
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.overload import QueueFull, overdue
from pdserve.scheduler.req import FinishReason, Req
from pdserve.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.reference import chat_ids, hf_greedy

PAGE = 16
POOL_PAGES = 12
PROMPT = chat_ids([{"role": "user", "content": "Name a color."}])


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    torch.set_num_threads(2)
    return ModelRunner(resolve_model(), dtype="float32", page_size=PAGE, max_total_tokens=POOL_PAGES * PAGE)


def req(rid: str, max_new: int = 8, arrival: float | None = None) -> Req:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    return Req(rid, list(PROMPT), params, arrival_time=arrival or time.time())


def drive(sched: Scheduler) -> dict[str, Req]:
    """Steps until idle; every finished request by rid."""
    done: dict[str, Req] = {}
    for _ in range(500):
        batch = sched.schedule()
        outputs = sched.pop_aborted()
        if batch is not None:
            outputs += sched.process_result(batch, sched.run_batch(batch))
        done |= {out.req.rid: out.req for out in outputs if out.finished}
        sched.check_invariants()
        if batch is None and not sched.has_work():
            break
    assert not sched.has_work() and sched.ledger.used_pages() == 0
    return done


def test_capacity_and_queue_bound_come_from_the_pool(runner: ModelRunner) -> None:
    sched = Scheduler(runner, SchedulerConfig(role="mixed"))
    # a minimal request holds 1 + 32 reserved tokens = 3 pages: 12 pages run 4 at once, 8 may wait
    assert (sched.request_capacity, sched.queue.bound) == (POOL_PAGES // 3, 2 * (POOL_PAGES // 3))
    capped = Scheduler(runner, SchedulerConfig(role="mixed", max_running_requests=2))
    assert (capped.request_capacity, capped.queue.bound) == (2, 4)
    explicit = Scheduler(runner, SchedulerConfig(role="mixed", max_queued_requests=3))
    assert explicit.queue.bound == 3


def test_a_full_queue_refuses_and_the_queued_requests_finish_exactly(runner: ModelRunner) -> None:
    sched = Scheduler(runner, SchedulerConfig(role="mixed", max_queued_requests=3))
    for i in range(3):
        sched.add_request(req(f"q{i}"))
    with pytest.raises(QueueFull, match=r"overloaded: 3 requests are already waiting .*queued-requests 3\)"):
        sched.add_request(req("refused"))
    assert "refused" not in sched.reqs and len(sched.queue.waiting) == 3
    assert sched.metrics.rejected.labels(reason="queue_full")._value.get() == 1
    done = drive(sched)
    expected = hf_greedy(PROMPT, 8)
    assert {rid: r.output_ids for rid, r in done.items()} == {f"q{i}": expected for i in range(3)}
    sched.add_request(req("after"))  # room again once they left the queue
    assert drive(sched)["after"].output_ids == expected


def test_no_bound_with_zero(runner: ModelRunner) -> None:
    sched = Scheduler(runner, SchedulerConfig(role="mixed", max_queued_requests=0))
    for i in range(50):
        sched.add_request(req(f"r{i}"))
    for i in range(50):
        assert sched.abort_request(f"r{i}")
    assert len(sched.pop_aborted()) == 50 and not sched.has_work()
    sched.check_invariants()


def test_requests_waiting_past_the_queue_time_fail_retryable(runner: ModelRunner) -> None:
    sched = Scheduler(runner, SchedulerConfig(role="mixed", max_queue_time=5.0))
    stale = req("stale", arrival=time.time() - 6.0)
    fresh = req("fresh")
    sched.add_request(stale)
    sched.add_request(fresh)
    done = drive(sched)
    assert stale.finish_reason == FinishReason.ERROR and stale.retryable and not stale.output_ids
    assert "overloaded: the request waited 6." in stale.error and "max-queue-time 5 s" in stale.error
    assert done["fresh"].output_ids == hf_greedy(PROMPT, 8) and not fresh.retryable
    assert sched.metrics.rejected.labels(reason="queue_time")._value.get() == 1


def test_only_requests_never_started_time_out() -> None:
    now = time.time()
    started = req("started", arrival=now - 100)
    started.output_ids = [1]  # retracted back into the queue after generating: never timed out
    waiting = req("waiting", arrival=now - 100)
    young = req("young", arrival=now - 1)
    assert [r.rid for r, _ in overdue([started, waiting, young], now, 10.0)] == ["waiting"]
    assert overdue([waiting], now, 0.0) == []  # 0 = no limit


def test_the_prefill_role_does_not_time_out_requests(runner: ModelRunner) -> None:
    """In PD the decode worker owns the request (and its deadline); its prefill is never dropped here."""
    sched = Scheduler(runner, SchedulerConfig(role="prefill", max_queue_time=1.0))
    sched.add_request(req("old", arrival=time.time() - 60))
    batch = sched.schedule()
    assert batch is not None and sched.pop_aborted() == []
    sched.process_result(batch, sched.run_batch(batch))
    (prefilled,) = sched.pop_prefilled()
    sched.prefill_sent(prefilled.rid, ok=True)
    assert not sched.has_work() and sched.ledger.used_pages() == 0
