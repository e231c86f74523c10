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
    assert tracker.rate("a") > 0.99 and tracker.rate("b") < 0.01 and tracker.rate("c") == pytest.approx(0.5)
    tracker.observe("a", 0, 0)  # no drafts: nothing learned
    tracker.release("a")
    assert tracker.rate("a") == 0.5
    with pytest.raises(ValueError, match="bad acceptance tracker settings"):
        AcceptanceTracker(prior=1.5)
    with pytest.raises(ValueError, match="two token counts"):
        LinearStepTime.fit([(4, 0.01), (4, 0.02)])
