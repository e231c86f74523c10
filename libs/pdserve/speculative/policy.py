"""What the per-step speculation policy (``pdserve.scheduler.speculator``) learns from: each
request's acceptance and the step time by tokens computed.

A request whose drafts each stand with probability ``a`` (the ``j``-th one only if all before it
did, so with ``a^j``) gains ``a + a^2 + ... + a^k`` tokens from ``k`` drafts (Leviathan et al. 2023,
the expected tokens a step of speculative decoding yields); a step computing ``T`` tokens costs
``t(T)`` (``make bench-spec``: on one thread of the reference CPU, SmolLM2 float32+w4a8 took 10.7 ms
for one decode, 22.4 ms for 1 + 8 drafts, 38.5 ms for 16 decodes and 231 ms for 16 x (1 + 8)).
``AcceptanceTracker`` estimates each request's ``a`` from its verify steps; ``LinearStepTime`` fits
``t(T)`` to measured steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
    failure), each step's counts decayed by ``decay``, starting from a prior worth ``prior_weight``
    drafts.

    The prior of a request not seen yet is the pooled rate of every request's recent verify steps
    (counts decayed by ``pooled_decay`` per step, from ``prior`` before any): on one deployment the
    text, and so how often drafts stand, changes slowly from request to request (an empirical-Bayes
    prior), so a new request speculates from its first steps where its predecessors' drafts stood,
    instead of waiting to be explored.

    Raises:
        ValueError: ``prior`` outside [0, 1], a decay outside (0, 1], a negative weight.
    """

    def __init__(
        self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.8, pooled_decay: float = 0.95
    ):
        if not (0 <= prior <= 1 and 0 < decay <= 1 and 0 < pooled_decay <= 1 and prior_weight >= 0):
            raise ValueError(
                f"bad acceptance tracker settings: {prior=}, {prior_weight=}, {decay=}, {pooled_decay=}"
            )
        self.prior, self.prior_weight = prior, prior_weight
        self.decay, self.pooled_decay = decay, pooled_decay
        self._counts: dict[str, tuple[float, float]] = {}
        self._pooled = (prior * prior_weight, prior_weight)

    def pooled_rate(self) -> float:
        """The rate of every request's recent verify steps: a new request's prior."""
        kept, tried = self._pooled
        return kept / tried if tried else self.prior

    def rate(self, rid: str) -> float:
        kept, tried = self._counts.get(rid) or self._start()
        return kept / tried if tried else self.pooled_rate()

    def observe(self, rid: str, num_drafts: int, num_accepted: int) -> None:
        """A verify step of ``num_drafts`` drafts of which the first ``num_accepted`` stood."""
        if num_drafts == 0:
            return
        failed = num_accepted < num_drafts
        kept, tried = self._counts.get(rid) or self._start()
        self._counts[rid] = (kept * self.decay + num_accepted, tried * self.decay + num_accepted + failed)
        kept, tried = self._pooled
        d = self.pooled_decay
        self._pooled = (kept * d + num_accepted, tried * d + num_accepted + failed)

    def release(self, rid: str) -> None:
        self._counts.pop(rid, None)

    def _start(self) -> tuple[float, float]:
        return self.pooled_rate() * self.prior_weight, self.prior_weight
