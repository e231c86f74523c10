"""``Speculator``: speculative decoding beside the decode stage (Leviathan et al. 2023; Chen et al.
2023): which running requests verify draft tokens this step, and how many.

Each step the decode stage asks ``wants`` whether speculation may pay for its running requests
(``plan_drafts`` on each request's estimated acceptance, before anything is drafted); if so it asks
``draft`` for their drafts, which the proposer makes from their verified tokens (so a step that
speculates needs the previous step's token ids: the overlap loop then runs one step at a time) and
``plan_drafts`` cuts again, now knowing what each proposal holds. A request's drafts are also cut
by what its ``max_tokens`` and the context leave (the step keeps at most ``k + 1`` tokens) and by
its grammar (before the first token it refuses: ``Grammar.masks_along``). A request with drafts
computes ``1 + k`` tokens in the step (``DecodeManager.num_tokens``); the verify step's result
tells ``observe`` how many stood.

The step time the policy weighs drafts against is fitted to the forwards this scheduler ran
(``LinearStepTime`` over the latest decode and verify steps, starting from a prior measured on the
reference CPU) plus, for a draft model, the proposer's own time per draft token.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from pdserve.scheduler.config import SPECULATIVE_POLICIES
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.scheduler.req import Req
from pdserve.speculative.policy import AcceptanceTracker, LinearStepTime, plan_drafts
from pdserve.speculative.proposer import DraftRequest, Proposer

# ``make bench-spec`` on one core of the reference CPU (SmolLM2 float32+w4a8): 10.7 ms for one
# decode, 22.4 ms for 1 + 8 tokens; the prior until this scheduler has timed steps of its own
PRIOR_STEP_TIME = LinearStepTime(intercept=9.2e-3, slope=1.5e-3)


class Speculator:
    """Drafts for the running requests of one scheduler.

    Args:
        proposer: makes the drafts (``pdserve.speculative``: n-gram, draft model).
        num_draft_tokens: ``k``, the most drafts a request verifies in a step (>= 1).
        policy: ``adaptive`` (drafts only where ``plan_drafts`` expects them to raise the step's
            throughput) or ``always`` (every request verifies what the proposer offers, up to ``k``).
        metrics: the spec_decode counters.
        vocab_size: the logits' width (a grammar's masks).

    Raises:
        ValueError: ``num_draft_tokens < 1``, an unknown policy.
    """

    def __init__(
        self,
        proposer: Proposer,
        num_draft_tokens: int,
        policy: str,
        metrics: SchedulerMetrics,
        vocab_size: int,
    ) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"speculative policy must be one of {SPECULATIVE_POLICIES}, got {policy!r}")
        self.proposer, self.k, self.policy = proposer, num_draft_tokens, policy
        self.metrics, self.vocab_size = metrics, vocab_size
        self.tracker = AcceptanceTracker()
        self.step_time = PRIOR_STEP_TIME
        self._steps: deque[tuple[int, float]] = deque(maxlen=256)  # (tokens, seconds) of recent forwards
        self._num_steps = 0
        self._draft_cost = 0.0  # seconds of proposing per draft token (a draft model's forwards)

    # ---- deciding ---------------------------------------------------------------------------
    def limit(self, req: Req, max_req_tokens: int) -> int:
        """The most drafts ``req`` may verify now: ``k``, within what its ``max_tokens`` and the
        context leave after the step's own token; 0 for a request that opted out."""
        params = req.sampling_params
        if params.speculative_num_draft_tokens == 0:
            return 0
        room = min(params.max_new_tokens - req.num_generated, max_req_tokens - req.seq_len) - 1
        cap = self.k if params.speculative_num_draft_tokens is None else params.speculative_num_draft_tokens
        return max(0, min(cap, self.k, room))

    def wants(self, reqs: Sequence[Req], max_req_tokens: int) -> bool:
        """Whether any of ``reqs`` (this step's decodes) may verify drafts: the policy's plan with
        each request's estimated acceptance and its ``limit``, before drafting."""
        limits = [self.limit(req, max_req_tokens) for req in reqs]
        return any(self._plan(reqs, limits))

    def draft(self, reqs: Sequence[Req], max_req_tokens: int) -> None:
        """Set ``req.drafts`` (and ``req.draft_probs``) of each of ``reqs``, whose token ids are all
        known (none pending): the proposer's drafts, cut by the limits and the policy."""
        limits = [self.limit(req, max_req_tokens) for req in reqs]
        asked = [(req, n) for req, n in zip(reqs, limits, strict=True) if n > 0]
        for req in reqs:
            req.drafts, req.draft_probs = [], None
        if not asked:
            return
        start = time.perf_counter()
        proposals = self.proposer.propose(
            [DraftRequest(r.rid, r.origin_input_ids, r.output_ids, n, r.sampling_params) for r, n in asked]
        )
        offered = [
            self._grammar_cut(r, list(d)) for (r, _), d in zip(asked, proposals.token_ids, strict=True)
        ]
        drafted = sum(map(len, offered))
        if drafted:
            seconds = (time.perf_counter() - start) / drafted
            self._draft_cost = seconds if not self._draft_cost else 0.8 * self._draft_cost + 0.2 * seconds
        # the plan weighs every decode of the step (those without drafts cost a token each too)
        lens = {r.rid: len(d) for (r, _), d in zip(asked, offered, strict=True)}
        plan = self._plan(reqs, [lens.get(r.rid, 0) for r in reqs])
        index = {r.rid: i for i, (r, _) in enumerate(asked)}
        for req, n in zip(reqs, plan, strict=True):
            if n:
                i = index[req.rid]
                req.drafts = offered[i][:n]
                probs = proposals.probs[i] if proposals.probs is not None else None
                req.draft_probs = None if probs is None else probs[:n]

    def _plan(self, reqs: Sequence[Req], limits: list[int]) -> list[int]:
        if self.policy == "always":
            return limits
        batch, cost, fitted = len(reqs), self._draft_cost, self.step_time
        rates = [self.tracker.rate(r.rid) for r in reqs]
        return plan_drafts(rates, limits, lambda tokens: fitted(tokens) + cost * (tokens - batch))

    def _grammar_cut(self, req: Req, drafts: list[int]) -> list[int]:
        """``drafts`` up to the first token ``req``'s grammar refuses (and none after one ending it)."""
        if req.grammar is None or not drafts:
            return drafts
        return drafts[: len(req.grammar.masks_along(drafts, self.vocab_size)) - 1]

    # ---- learning -----------------------------------------------------------------------------
    def observe(self, req: Req, num_drafts: int, num_accepted: int) -> None:
        """A verify step of ``req`` kept ``num_accepted`` of its ``num_drafts`` drafts."""
        self.tracker.observe(req.rid, num_drafts, num_accepted)
        self.metrics.spec_decode_num_drafts.inc()
        self.metrics.spec_decode_num_draft_tokens.inc(num_drafts)
        self.metrics.spec_decode_num_accepted_tokens.inc(num_accepted)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A decode or verify forward of ``tokens`` tokens took ``seconds``: refit the step time
        every 32 steps, once steps of two token counts or more were seen."""
        self._steps.append((tokens, seconds))
        self._num_steps += 1
        if self._num_steps % 32 == 0 and len({t for t, _ in self._steps}) > 1:
            self.step_time = LinearStepTime.fit(list(self._steps))

    def release(self, rid: str) -> None:
        """``rid`` ended: forget its proposer state and acceptance."""
        self.proposer.release(rid)
        self.tracker.release(rid)
