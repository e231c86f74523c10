"""What the speculation policy learns from: the step-time fit and the acceptance estimates."""

from __future__ import annotations

import pytest

from pdserve.speculative.policy import AcceptanceTracker, LinearStepTime

# make bench-spec, SmolLM2 float32+w4a8, one thread of the reference CPU (ms): t(B, k) at B = 1, 4, 16
MEASURED = {
    (1, 0): 10.7, (1, 2): 14.0, (1, 4): 17.2, (1, 8): 22.4, (4, 0): 17.4, (4, 2): 27.6,
    (4, 4): 38.5, (4, 8): 60.4, (16, 0): 38.5, (16, 2): 83.9, (16, 4): 129.4, (16, 8): 231.2,
}  # fmt: skip
STEP = LinearStepTime.fit([(b * (k + 1), ms / 1e3) for (b, k), ms in MEASURED.items()])


def test_the_fit_follows_the_measured_steps():
    for (batch, k), ms in MEASURED.items():
        assert STEP(batch * (k + 1)) * 1e3 == pytest.approx(ms, rel=0.25)


def test_acceptance_estimates_follow_what_stands():
    tracker = AcceptanceTracker(prior=0.5, prior_weight=2.0, decay=0.8)
    assert tracker.rate("a") == 0.5
    for _ in range(20):
        tracker.observe("a", 4, 4)  # every draft stands
        tracker.observe("b", 4, 0)  # none does
        tracker.observe("c", 4, 1)  # one, then a rejection
    assert tracker.rate("a") > 0.99 and tracker.rate("b") < 0.01
    assert tracker.rate("c") == pytest.approx(0.5, abs=1e-2)
    tracker.observe("a", 0, 0)  # no drafts: nothing learned
    tracker.release("a")
    # a request not seen yet starts from every request's recent rate: here (4 + 0 + 1) kept of
    # (4 + 1 + 2) tried a round, about 5/7 (the latest steps weigh most)
    assert tracker.rate("a") == tracker.pooled_rate() == pytest.approx(5 / 7, abs=0.03)
    fresh = AcceptanceTracker(prior=0.5)
    for _ in range(40):
        fresh.observe("a", 4, 4)
    assert fresh.rate("new") > 0.99  # drafts have stood: a new request speculates from its first step
    fresh.observe("new", 4, 0)
    assert fresh.rate("new") < 0.7 and fresh.rate("other") > 0.95
    with pytest.raises(ValueError, match="bad acceptance tracker settings"):
        AcceptanceTracker(prior=1.5)
    with pytest.raises(ValueError, match="two token counts"):
        LinearStepTime.fit([(4, 0.01), (4, 0.02)])
