"""When speculation pays: how many draft tokens each request verifies in a step.

A request whose drafts each stand with probability ``a`` (the ``j``-th one only if all before it
did, so with ``a^j``) gains ``a + a^2 + ... + a^k`` tokens from ``k`` drafts (Leviathan et al. 2023,
the expected tokens a step of speculative decoding yields). The step costs more with each token it
computes: ``t(T)`` for ``T`` tokens (``make bench-spec``: on one thread of the reference CPU,
SmolLM2 float32+w4a8 took 10.7 ms for one decode, 22.4 ms for 1 + 8 drafts, 38.5 ms for 16 decodes
and 231 ms for 16 x (1 + 8)). A step's throughput is ``(B + gains) / t(T)``; adding one draft slot
with gain ``g`` and time ``dt`` raises it exactly when ``g / dt`` beats the throughput so far, so
``plan_drafts`` adds slots in order of decreasing gain while that holds. Requests whose drafts
rarely stand, and large batches (where every token costs the same as a request's own decode), get
none: the step is then a plain decode step, and speculation costs nothing.

``AcceptanceTracker`` estimates each request's ``a`` from its verify steps; ``LinearStepTime`` fits
``t(T)`` to measured steps.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def plan_drafts(
    acceptance: Sequence[float], limits: Sequence[int], step_time: Callable[[int], float]
) -> list[int]:
    """How many drafts each request should verify this step.

    Args:
        acceptance: per request, the estimated probability that a draft stands (in [0, 1]).
        limits: per request, the most drafts it may verify (what its proposer offers, what its
            ``max_tokens`` leaves, the scheduler's ``k``).
        step_time: seconds of a step computing ``T`` tokens (increasing in ``T``).

    Returns:
        per request, the number of drafts (0 where speculation does not pay).
    """
    tokens = len(acceptance)
    expected = float(tokens)  # each request's own next token
    heap = [(-a, i, 1) for i, (a, n) in enumerate(zip(acceptance, limits, strict=True)) if n > 0 and a > 0]
    heapq.heapify(heap)
    plan = [0] * tokens
    while heap:
        gain, i, j = -heap[0][0], heap[0][1], heap[0][2]
        now = step_time(tokens)
        if gain * now <= expected * (step_time(tokens + 1) - now):
            break  # this slot, and every later one (gains only fall), lowers the throughput
        heapq.heappop(heap)
        plan[i], tokens, expected = j, tokens + 1, expected + gain
        if j < limits[i]:
            heapq.heappush(heap, (-gain * acceptance[i], i, j + 1))
    return plan


@dataclass(slots=True)
class LinearStepTime:
    """``t(T) = intercept + slope * T`` seconds, fitted to measured ``(tokens, seconds)`` steps by
    least squares (``fit``)."""

    intercept: float
    slope: float

    def __call__(self, tokens: int) -> float:
        return self.intercept + self.slope * tokens

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> LinearStepTime:
        """Raises ValueError with fewer than two distinct token counts."""
        n = len(samples)
        mean_t = sum(t for t, _ in samples) / n if n else 0.0
        mean_s = sum(s for _, s in samples) / n if n else 0.0
        var = sum((t - mean_t) ** 2 for t, _ in samples)
        if not var:
            raise ValueError("fitting a step time needs steps of at least two token counts")
        slope = sum((t - mean_t) * (s - mean_s) for t, s in samples) / var
        return cls(mean_s - slope * mean_t, max(slope, 0.0))


class AcceptanceTracker:
    """Per request, the probability that a draft stands: drafts kept over drafts kept plus
    rejections (a step keeping ``a`` of ``k`` drafts saw ``a`` successes and, if ``a < k``, one
    failure), each step's counts decayed by ``decay``, starting from ``prior`` worth
    ``prior_weight`` drafts.

    Raises:
        ValueError: ``prior`` outside [0, 1], ``decay`` outside (0, 1], a negative weight.
    """

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.8):
        if not (0 <= prior <= 1 and 0 < decay <= 1 and prior_weight >= 0):
            raise ValueError(f"bad acceptance tracker settings: {prior=}, {prior_weight=}, {decay=}")
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self._counts: dict[str, tuple[float, float]] = {}

    def rate(self, rid: str) -> float:
        kept, tried = self._counts.get(rid, (self.prior * self.prior_weight, self.prior_weight))
        return kept / tried if tried else self.prior

    def observe(self, rid: str, num_drafts: int, num_accepted: int) -> None:
        """A verify step of ``num_drafts`` drafts of which the first ``num_accepted`` stood."""
        if num_drafts == 0:
            return
        kept, tried = self._counts.get(rid, (self.prior * self.prior_weight, self.prior_weight))
        failed = num_accepted < num_drafts
        self._counts[rid] = (kept * self.decay + num_accepted, tried * self.decay + num_accepted + failed)

    def release(self, rid: str) -> None:
        self._counts.pop(rid, None)
