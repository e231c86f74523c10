"""The per-step speculation policy: drafts where they pay (high acceptance, small batches), none where
they do not, the throughput-optimal plan under a linear step time, and the acceptance estimates."""

from __future__ import annotations

import itertools
import random

import pytest

from pdserve.speculative.policy import AcceptanceTracker, LinearStepTime, plan_drafts

# make bench-spec, SmolLM2 float32+w4a8, one thread of the reference CPU (ms): t(B, k) at B = 1, 4, 16
MEASURED = {
    (1, 0): 10.7, (1, 2): 14.0, (1, 4): 17.2, (1, 8): 22.4, (4, 0): 17.4, (4, 2): 27.6,
    (4, 4): 38.5, (4, 8): 60.4, (16, 0): 38.5, (16, 2): 83.9, (16, 4): 129.4, (16, 8): 231.2,
}  # fmt: skip
STEP = LinearStepTime.fit([(b * (k + 1), ms / 1e3) for (b, k), ms in MEASURED.items()])


def throughput(acceptance, plan, step_time) -> float:
    gains = sum(sum(a**j for j in range(1, k + 1)) for a, k in zip(acceptance, plan, strict=True))
    return (len(plan) + gains) / step_time(len(plan) + sum(plan))


def test_the_fit_follows_the_measured_steps():
    for (batch, k), ms in MEASURED.items():
        assert STEP(batch * (k + 1)) * 1e3 == pytest.approx(ms, rel=0.25)


def test_one_request_drafting_well_verifies_many_and_a_big_batch_none():
    assert plan_drafts([0.9], [8], STEP) == [8]
    assert 1 <= plan_drafts([0.6], [8], STEP)[0] <= 4
    assert plan_drafts([0.05], [8], STEP) == [0]
    assert plan_drafts([0.5] * 16, [8] * 16, STEP) == [0] * 16  # break-even at B = 16 was 0.56 for k = 1
    assert plan_drafts([0.95] * 16, [8] * 16, STEP) != [0] * 16


def test_requests_with_good_drafts_get_them_first():
    plan = plan_drafts([0.9, 0.2, 0.7, 0.0], [6, 6, 6, 6], STEP)
    assert plan[0] >= plan[2] > plan[1] == plan[3] == 0
    assert plan_drafts([0.9, 0.9], [2, 0], STEP) == [2, 0]  # within each request's limit


def test_the_plan_is_the_best_one_under_a_linear_step_time():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 3)
        acceptance = [rng.random() for _ in range(n)]
        limits = [rng.randint(0, 3) for _ in range(n)]
        step = LinearStepTime(rng.uniform(0.005, 0.02), rng.uniform(0.0005, 0.005))
        best = max(
            throughput(acceptance, p, step) for p in itertools.product(*(range(m + 1) for m in limits))
        )
        assert throughput(acceptance, plan_drafts(acceptance, limits, step), step) == pytest.approx(best)


def test_acceptance_estimates_follow_what_stands():
    tracker = AcceptanceTracker(prior=0.5, prior_weight=2.0, decay=0.8)
    assert tracker.rate("a") == 0.5
    for _ in range(20):
        tracker.observe("a", 4, 4)  # every draft stands
        tracker.observe("b", 4, 0)  # none does
        tracker.observe("c", 4, 1)  # one, then a rejection
    assert tracker.rate("a") > 0.99 and tracker.rate("b") < 0.01 and tracker.rate("c") == pytest.approx(0.5)
    tracker.observe("a", 0, 0)  # no drafts: nothing learned
    tracker.release("a")
    assert tracker.rate("a") == 0.5
    with pytest.raises(ValueError, match="bad acceptance tracker settings"):
        AcceptanceTracker(prior=1.5)
    with pytest.raises(ValueError, match="two token counts"):
        LinearStepTime.fit([(4, 0.01), (4, 0.02)])
