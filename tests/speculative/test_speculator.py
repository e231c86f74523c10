"""The scheduler's ``Speculator`` without a model: which requests draft, how many, and when the
adaptive policy steps aside (a speculative step slower per token than a plain one), exploring once in
``EXPLORE_EVERY`` refusals; drafts cut by ``max_tokens``, the per-request cap and opt-out."""

from __future__ import annotations

import time

from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.scheduler.req import Req
from pdserve.scheduler.schedule_batch import ScheduleBatch
from pdserve.scheduler.speculator import ALONE, EXPLORE_EVERY, PLAIN, VERIFY, Speculator
from pdserve.speculative.ngram import NgramProposer
from pdserve.speculative.policy import LinearStepTime

LOOP = [5, 6, 7, 8] * 6  # a prompt that repeats: n-gram drafts continue the loop


def running(rid: str, max_new: int = 64, **params) -> Req:
    req = Req(rid, list(LOOP), SamplingParams(temperature=0.0, max_new_tokens=max_new, **params))
    req.output_ids = [5]
    return req


def speculator(policy: str = "adaptive") -> Speculator:
    return Speculator(NgramProposer(), 4, policy, SchedulerMetrics("mixed"), vocab_size=100, clock=time.time)


def test_drafts_are_cut_by_max_tokens_the_cap_and_the_opt_out():
    spec = speculator("always")
    reqs = [running("a"), running("b", max_new=3), running("c", speculative_num_draft_tokens=2)]
    reqs.append(running("d", speculative_num_draft_tokens=0))
    assert spec.wants(reqs, max_req_tokens=4096)
    spec.draft(reqs, max_req_tokens=4096)
    assert [r.drafts for r in reqs] == [[6, 7, 8, 5], [6], [6, 7], []]
    spec.draft([running("e")], max_req_tokens=len(LOOP) + 3)  # the context leaves room for 1 draft
    assert not spec.wants([running("d", speculative_num_draft_tokens=0)], 4096)


def test_adaptive_speculates_where_steps_pay_and_explores_where_they_do_not():
    spec = speculator()
    reqs = [running("a")]
    for _ in range(3):  # every draft stood so far
        spec.tracker.observe("a", 4, 4)
    assert spec.wants(reqs, 4096)
    spec.draft(reqs, 4096)
    assert reqs[0].drafts == [6, 7, 8, 5]
    # speculative steps measured 10x slower than plain ones: a plan no longer pays
    spec.step_time[VERIFY] = LinearStepTime(0.1, 0.01)
    spec.step_time[ALONE] = LinearStepTime(0.01, 0.001)
    decisions = []
    for _ in range(2 * EXPLORE_EVERY):
        decisions.append(spec.wants(reqs, 4096))
        if decisions[-1]:  # an exploring step stands when asked again, until it drafted
            assert spec.wants(reqs, 4096, in_flight=True)
            spec.draft(reqs, 4096)
            assert reqs[0].drafts == [6, 7, 8, 5]
    assert decisions.count(True) == 2 and decisions[EXPLORE_EVERY - 1]
    assert not spec.wants(reqs, 4096)
    spec.draft(reqs, 4096)  # (had the loop drafted after all:) a plan that does not pay drafts nothing
    assert reqs[0].drafts == []


def test_step_times_are_refit_from_the_periods_seen():
    spec = speculator()
    spec.observe_step(8, 5.0, VERIFY)  # a first forward of its shape: left out of the fit
    for i in range(15):
        spec.observe_step(8 + i % 4, 0.02 + 0.001 * (8 + i % 4), VERIFY)
        spec.observe_step(4, 0.05, PLAIN)
    spec.observe_step(4, 0.05, PLAIN)
    assert abs(spec.step_time[VERIFY](10) - 0.03) < 1e-9 and abs(spec.step_time[VERIFY].slope - 0.001) < 1e-9
    assert abs(spec.step_time[PLAIN](4) - 0.05) < 1e-9  # one batch size seen: the prior's slope, shifted


def test_refused_requests_learn_their_acceptance_from_shadow_drafts():
    spec = speculator()
    # a speculative step 3x a plain one: drafts standing half the time do not pay, all the time do
    spec.step_time[VERIFY], spec.step_time[ALONE] = LinearStepTime(0.03, 0.0), LinearStepTime(0.01, 0.0)
    loop, off = running("loop"), running("off")
    assert not spec.wants([loop, off], 4096)  # the prior (0.5) does not pay: both keep shadow drafts
    for token in [6, 7, 8]:  # the loop goes on as drafted; "off" writes something else
        loop.output_ids.append(token)
        off.output_ids.append(99)
        assert not spec.wants([loop, off], 4096)
    assert spec.tracker.rate("off") < 0.5  # its shadow missed at the first token: 0 of 4 stood
    loop.output_ids.append(5)
    assert spec.wants([loop], 4096)  # its 4 shadow drafts stood: it pays now, 28 steps before exploring
    assert spec.tracker.rate("loop") > 0.8
    spec.draft([loop], 4096)
    assert loop.drafts == [6, 7, 8, 5]
    spec.release("loop")
    assert "loop" not in spec._shadows


def test_a_step_is_weighed_against_the_plain_step_it_would_otherwise_be():
    """A plain step overlaps the batch in flight; with none in flight (right after a verify step,
    whose tokens it needs) it runs alone and costs more: the same plan can pay then and not before."""
    spec = speculator()
    reqs = [running("a")]  # the prior: half the drafts stand, 1 + 0.94 tokens a verify step
    spec.step_time[VERIFY] = LinearStepTime(0.02, 0.0)
    spec.step_time[PLAIN], spec.step_time[ALONE] = LinearStepTime(0.0099, 0.0), LinearStepTime(0.0133, 0.0)
    assert not spec.wants(reqs, 4096, in_flight=True)
    assert spec.wants(reqs, 4096, in_flight=False)


def test_a_step_after_the_scheduler_idled_is_not_timed():
    """Each decode step is timed from the one processed before it, except the first after an idle
    wait (one stream, PD: from a request's last token to the next request's KV), which is no step's
    cost; the steps after it are timed again."""
    now = [0.0]
    spec = Speculator(NgramProposer(), 4, "adaptive", SchedulerMetrics("mixed"), 100, clock=lambda: now[0])
    step = ScheduleBatch([running("a")], [1], num_extend=0)
    for t in (1.0, 1.01, 1.02):
        now[0] = t
        spec.step_processed(step)
    spec.idle()
    for t in (9.0, 9.01):
        now[0] = t
        spec.step_processed(step)
    assert [round(s, 6) for _, s in spec._periods[ALONE]] == [0.01, 0.01, 0.01]  # (none pending here)
