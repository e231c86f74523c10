"""The priority schedule policy on the real model: admission by priority, preemption of a lower
priority running request (retracted, then finished without loss), and the bounds of ``priority``."""

from __future__ import annotations

import pytest

from pdserve.engine.model_runner import ModelRunner
from pdserve.sampling.bounds import BoundError
from pdserve.scheduler.req import ReqState
from tests.reference import chat_ids, hf_greedy
from tests.scheduler.driver import PAGE, drive, fresh, ids, make_runner, req, step

MAX_NEW = 8


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_runner(64 * PAGE)


def test_a_high_priority_request_preempts_the_lowest_running_one(runner, overlap=True):
    """Two low-priority requests fill the running batch; a third low one waits. A high-priority
    request that arrives after it is admitted first, by retracting the newest low-priority runner,
    and has its first token before the waiting low one is admitted. Their outputs are HF's.
    Overlapped steps (the loop's order): the retraction waits for the batch in flight."""
    sched = fresh(runner, role="mixed", schedule_policy="priority", max_running_requests=2)
    topics = ("ships", "trees", "snow", "birds")
    prompts = {t: chat_ids([{"role": "user", "content": f"Write a short poem about {t}."}]) for t in topics}
    sched.add_request(req("ships", prompts["ships"], MAX_NEW, priority=5))
    sched.add_request(req("trees", prompts["trees"], MAX_NEW, priority=5))
    prev = None
    for _ in range(3):  # both prefilled and decoding
        _, prev = step(sched, prev, overlap)
    assert [r.rid for r in sched.decode.running] == ["ships", "trees"]
    sched.add_request(req("snow", prompts["snow"], MAX_NEW, priority=5))  # equal: never preempts
    _, prev = step(sched, prev, overlap)
    assert sched.reqs["snow"].state is ReqState.WAITING and sched.metrics.retracted._value.get() == 0
    birds = req("birds", prompts["birds"], MAX_NEW, priority=-3)
    sched.add_request(birds)
    while not birds.output_ids:
        _, prev = step(sched, prev, overlap)
        assert sched.reqs["snow"].state is ReqState.WAITING, "a lower priority was admitted first"
    assert sched.metrics.retracted._value.get() == 1
    assert sched.reqs["trees"].state is ReqState.WAITING and sched.reqs["trees"].output_ids  # kept its tokens
    if prev is not None:
        sched.process_result(prev)
    done = drive(sched, overlap)
    assert set(done) == set(prompts)
    for rid in ("trees", "birds"):  # the retracted one, and the one that preempted it
        assert done[rid].output_ids == hf_greedy(prompts[rid], MAX_NEW), rid
    assert done["birds"].first_token_time <= done["snow"].admit_time


def test_priority_is_bounded_and_refused_under_other_policies(runner):
    prompt = ids("Hello")
    fcfs = fresh(runner, role="mixed")
    with pytest.raises(BoundError, match="priority is only accepted under --schedule-policy priority"):
        fcfs.add_request(req("a", prompt, priority=1))
    fcfs.add_request(req("b", prompt, priority=0))  # the default is accepted by every policy
    assert len(drive(fcfs)) == 1
    sched = fresh(runner, role="mixed", schedule_policy="priority")
    for value in (-1001, 1001):
        with pytest.raises(BoundError, match=r"priority must be in \[-1000, 1000\]"):
            sched.add_request(req(f"r{value}", prompt, priority=value))
    assert not sched.reqs and sched.ledger.used_pages() == 0


def test_a_high_priority_request_preempts_for_kv_room(overlap=True):
    """The batch has room but the pool does not: two low-priority requests hold the reserve a high
    one needs, so the newest of them is retracted (its KV kept in the radix cache) and the high one
    admitted in the next step; the retracted one still finishes with HF's tokens. Its own small
    runner (12 pages), freed with the test."""
    small = make_runner(12 * PAGE)
    sched = fresh(small, role="mixed", schedule_policy="priority")
    topics = ("ships", "trees", "birds")
    prompts = {t: chat_ids([{"role": "user", "content": f"Write a short poem about {t}."}]) for t in topics}
    sched.add_request(req("ships", prompts["ships"], 40, priority=5))
    sched.add_request(req("trees", prompts["trees"], 40, priority=5))
    prev = None
    for _ in range(3):
        _, prev = step(sched, prev, overlap)
    birds = req("birds", prompts["birds"], 40, priority=-1)
    assert len(sched.decode.running) == 2 and sched.preemption.admission.blocked(birds)
    sched.add_request(birds)
    for _ in range(2):  # the retraction waits for the batch in flight, then birds is prefilled
        _, prev = step(sched, prev, overlap)
    assert birds.output_ids and sched.metrics.retracted._value.get() == 1
    if prev is not None:
        sched.process_result(prev)
    done = drive(sched, overlap)
    assert done["trees"].output_ids == hf_greedy(prompts["trees"], 40)
    del sched, small
