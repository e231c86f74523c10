"""``Speculator``: speculative decoding beside the decode stage (Leviathan et al. 2023; Chen et al.
2023): which running requests verify draft tokens this step, and how many.

Each step the decode stage asks ``wants`` whether this step speculates (before anything is drafted);
if so it asks ``draft`` for the requests' drafts, which the proposer makes from their verified
tokens (so a step that speculates needs the previous step's token ids: the overlap loop then runs
one step at a time). A request's drafts are cut by what its ``max_tokens`` and the context leave
(the step keeps at most ``k + 1`` tokens), its own cap (``speculative_num_draft_tokens``; 0 opts
out) and its grammar (before the first token it refuses: ``Grammar.masks_along``). A request with
drafts computes ``1 + k`` tokens in the step (``DecodeManager.num_tokens``); the verify step's
result tells ``observe`` how many stood.

The policy weighs the wall-clock time of this scheduler's own steps, per step and not per forward: a
speculative step also pays for its drafting and, under the overlap loop, for the overlap it gives up
(it waits for the previous step's tokens), so three ``LinearStepTime`` fits are kept, of the periods
between processed decode steps: plain steps that overlapped the step before (by batch size), plain
steps that ran alone (by batch size: one scheduled right after a verify step can only start once its
tokens are known), and verify steps (by tokens computed), each from a prior until steps of its kind
were seen. A step is weighed against the plain step it would otherwise be: one that overlaps when a
batch is in flight, one alone when none is (on a 2-core Zen 4, PD 1+1, batch 1: 9.9 ms overlapped,
13.3 ms alone, 11.6 ms for a verify step of 1 + 4 tokens; weighing every plain step at one fit
refused steps that paid, ~0.88x of ``always`` at one stream). The first step after the scheduler
idled is not timed (``idle``: its period would span the wait). The decision is per step: every
request whose drafts stand often enough (``AcceptanceTracker``, at least ``MIN_ACCEPTANCE``)
verifies all it may, and the step speculates when that plan's expected throughput ``(B + gains) /
t_spec(T)`` (a request with acceptance ``a`` and ``j`` drafts gains ``a + ... + a^j``: Leviathan et
al. 2023) beats a plain step's ``B / t_plain(B)``. One step in ``EXPLORE_EVERY`` that this refuses
speculates anyway, every request drafting, so that the fit of speculative steps and each request's
acceptance follow the machine's load and the text; such a step stands until it drafts (asked again
after waiting for the batch in flight, it would otherwise be refused again, and a wrong fit never
corrected). Where drafts cost nothing (n-gram), a request that does not verify in a step still gets
drafts, kept aside as a shadow and scored against the tokens it then generates (a sampled token
equals a point-mass draft with the probability the rejection rule would accept it), so its
acceptance follows the text between explorations too.
(Cutting drafts per request by their marginal gain over the engine's step time (an earlier
planner) drafted ~2 per request at batch 16 and ran 0.84x of plain decoding there while drafting
all of them ran 1.27x: a step's fixed costs make its last drafts cheaper than the forward's slope
says.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from pdserve.scheduler.config import SPECULATIVE_POLICIES
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.scheduler.req import Req
from pdserve.scheduler.schedule_batch import ScheduleBatch
from pdserve.speculative.policy import AcceptanceTracker, LinearStepTime
from pdserve.speculative.proposer import DraftRequest, Proposer

# ``make bench-spec`` on one core of the reference CPU (SmolLM2 float32+w4a8): 10.7 ms for one
# decode, 22.4 ms for 1 + 8 tokens; the priors until this scheduler has timed steps of its own (a
# speculative step: the same forward, not overlapped with the ~2 ms of scheduling around it)
PRIOR_STEP_TIME = LinearStepTime(intercept=9.2e-3, slope=1.5e-3)
PRIOR_SPEC_STEP_TIME = LinearStepTime(intercept=11.2e-3, slope=1.5e-3)
PRIOR_ALONE_STEP_TIME = PRIOR_SPEC_STEP_TIME  # a plain step not overlapped: the same ~2 ms more
# the kinds of decode step timed apart
PLAIN, ALONE, VERIFY = "plain", "alone", "verify"
EXPLORE_EVERY = 32  # a refused speculative plan runs anyway once in this many steps
MIN_ACCEPTANCE = 0.3  # a request whose drafts stand less often drafts only in exploring steps
REFIT_EVERY = 8  # steps of a kind between refits of its step time
WINDOW = 64  # the latest steps of a kind its step time is fitted to


class Speculator:
    """Drafts for the running requests of one scheduler.

    Args:
        proposer: makes the drafts (``pdserve.speculative``: n-gram, draft model).
        num_draft_tokens: ``k``, the most drafts a request verifies in a step (>= 1).
        policy: ``adaptive`` (speculates in the steps where it is expected to raise the throughput)
            or ``always`` (every request verifies what the proposer offers, up to ``k``).
        metrics: the spec_decode counters.
        vocab_size: the logits' width (a grammar's masks).
        clock: seconds; the scheduler's clock, whose readings every rank of a tensor-parallel
            scheduler shares (rank 0's of each step), so that every rank fits the same step times
            and makes the same decisions.

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
        clock: Callable[[], float],
    ) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"speculative policy must be one of {SPECULATIVE_POLICIES}, got {policy!r}")
        self.proposer, self.k, self.policy = proposer, num_draft_tokens, policy
        self.metrics, self.vocab_size, self.clock = metrics, vocab_size, clock
        self.tracker = AcceptanceTracker()
        # wall-clock periods of processed decode steps, by kind (PLAIN, ALONE, VERIFY)
        self.step_time = {PLAIN: PRIOR_STEP_TIME, ALONE: PRIOR_ALONE_STEP_TIME, VERIFY: PRIOR_SPEC_STEP_TIME}
        self._periods = {kind: deque(maxlen=WINDOW) for kind in self.step_time}
        self._seen = dict.fromkeys(self.step_time, 0)
        self._plain = PLAIN  # the plain step this step would otherwise be (``wants``)
        self._refused = 0  # plans the comparison refused (every EXPLORE_EVERY-th runs)
        self._exploring = False
        self._last_decode_done: float | None = None  # when the latest decode-only step was processed
        # rid -> (drafts not verified, len(output_ids) when drafted): scored once the tokens are known
        self._shadows: dict[str, tuple[list[int], int]] = {}

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

    def wants(self, reqs: Sequence[Req], max_req_tokens: int, in_flight: bool = False) -> bool:
        """Whether this step (``reqs``: its decodes) speculates, decided before drafting; ``in_flight``:
        a batch is running, which a plain step would overlap (a verify step waits for it)."""
        self._plain = PLAIN if in_flight else ALONE
        self._score_shadows(reqs)
        limits = [self.limit(req, max_req_tokens) for req in reqs]
        if self.policy == "always" or not any(limits):
            return any(limits)
        if self._exploring:  # asked again after waiting for the tokens of the batch in flight
            return True
        if self._pays(reqs, self._plan(reqs, limits)):
            return True
        self._refused += 1
        self._exploring = self._refused % EXPLORE_EVERY == 0
        if not self._exploring and self.proposer.drafts_are_free:
            asked = [(r, n) for r, n in zip(reqs, limits, strict=True) if n and r.rid not in self._shadows]
            if asked:
                drafts = self.proposer.propose([self._draft_request(r, n) for r, n in asked]).token_ids
                self._keep_shadows([r for r, _ in asked], drafts)
        return self._exploring

    def draft(self, reqs: Sequence[Req], max_req_tokens: int) -> None:
        """Set ``req.drafts`` (and ``req.draft_probs``) of each of ``reqs``, whose token ids are all
        known (none pending): the proposer's drafts, cut by the limits and the policy."""
        exploring, self._exploring = self._exploring, False
        limits = [self.limit(req, max_req_tokens) for req in reqs]
        asked = [(req, n) for req, n in zip(reqs, limits, strict=True) if n > 0]
        for req in reqs:
            req.drafts, req.draft_probs = [], None
        if not asked:
            return
        proposals = self.proposer.propose([self._draft_request(r, n) for r, n in asked])
        offered = [
            self._grammar_cut(r, list(d)) for (r, _), d in zip(asked, proposals.token_ids, strict=True)
        ]
        lens = {r.rid: len(d) for (r, _), d in zip(asked, offered, strict=True)}
        limits = [lens.get(r.rid, 0) for r in reqs]
        plan = limits if self.policy == "always" or exploring else self._plan(reqs, limits)
        index = {r.rid: i for i, (r, _) in enumerate(asked)}
        # what was offered may not pay after all (adaptive): then a plain step
        declined = self.policy == "adaptive" and not exploring and not self._pays(reqs, plan)
        verifying = set() if declined else {r.rid for r, n in zip(reqs, plan, strict=True) if n}
        if self.proposer.drafts_are_free:  # drafts not verified are scored as shadows
            left = [r for r, _ in asked if r.rid not in verifying]
            self._keep_shadows(left, [offered[index[r.rid]] for r in left])
        if declined:
            return
        for req, n in zip(reqs, plan, strict=True):
            if n:
                i = index[req.rid]
                req.drafts = offered[i][:n]
                probs = proposals.probs[i] if proposals.probs is not None else None
                req.draft_probs = None if probs is None else probs[:n]

    def _plan(self, reqs: Sequence[Req], limits: list[int]) -> list[int]:
        """Each request's drafts: all it may where its drafts stand often enough, else none."""
        rates = (self.tracker.rate(r.rid) for r in reqs)
        return [n if a >= MIN_ACCEPTANCE else 0 for a, n in zip(rates, limits, strict=True)]

    def _pays(self, reqs: Sequence[Req], plan: list[int]) -> bool:
        """Whether ``plan`` is expected to yield more tokens per second than a plain step."""
        batch, tokens = len(reqs), len(reqs) + sum(plan)
        if tokens == batch:
            return False
        gains = sum(
            sum(a**j for j in range(1, n + 1))
            for a, n in zip((self.tracker.rate(r.rid) for r in reqs), plan, strict=True)
        )
        return (batch + gains) / self.step_time[VERIFY](tokens) > batch / self.step_time[self._plain](batch)

    @staticmethod
    def _draft_request(req: Req, num_drafts: int) -> DraftRequest:
        return DraftRequest(req.rid, req.origin_input_ids, req.output_ids, num_drafts, req.sampling_params)

    def _keep_shadows(self, reqs: Sequence[Req], drafts: Sequence[Sequence[int]]) -> None:
        """Keep each request's ``drafts`` (not verified) to score once its next tokens are known."""
        for req, d in zip(reqs, drafts, strict=True):
            if d and req.rid not in self._shadows:
                self._shadows[req.rid] = (list(d), len(req.output_ids))

    def _score_shadows(self, reqs: Sequence[Req]) -> None:
        """Score the shadow drafts of ``reqs`` whose outcome is known: the tokens generated since
        differ from a draft, or cover them all (the acceptance a verify step would have had)."""
        for req in reqs:
            shadow = self._shadows.get(req.rid)
            if shadow is None:
                continue
            drafts, start = shadow
            if len(req.output_ids) < start:  # not the request that drafted them (a reused rid)
                del self._shadows[req.rid]
                continue
            known = req.output_ids[start : start + len(drafts)]
            misses = (j for j, (d, t) in enumerate(zip(drafts, known, strict=False)) if d != t)
            stood = next(misses, len(known))
            if stood < len(known) or stood == len(drafts):
                self.tracker.observe(req.rid, len(drafts), stood)
                del self._shadows[req.rid]

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

    def step_processed(self, batch: ScheduleBatch) -> None:
        """``batch`` was processed: time a decode-only step from the previous one's processing to its
        own (the wall clock of the loop, which a speculative step pays in full), as a verify step, a
        plain one that overlapped the batch before (its input tokens were pending) or one alone."""
        now, last = self.clock(), self._last_decode_done
        decoding = batch.num_extend == 0 and not batch.row_errors
        self._last_decode_done = now if decoding else None
        if decoding and last is not None:
            kind = VERIFY if batch.verifies else PLAIN if batch.pending else ALONE
            self.observe_step(sum(batch.extend_lens), now - last, kind)

    def idle(self) -> None:
        """Nothing runs or waits to run: the next decode step is not timed, its period would span
        the wait (at one stream, PD: the time from a request's last token to the next request's KV)."""
        self._last_decode_done = None

    def observe_step(self, tokens: int, seconds: float, kind: str) -> None:
        """A decode step of ``kind`` (``PLAIN``, ``ALONE``, ``VERIFY``) of ``tokens`` tokens took
        ``seconds`` of wall clock from the previous step's processing to its own: refit that kind's
        step time every ``REFIT_EVERY`` such steps, over the latest ``WINDOW`` of them without outliers
        (a period above three times their median: a first forward of its shape, a stall of the
        machine), and through the prior's slope while one token count was seen."""
        periods = self._periods[kind]
        periods.append((tokens, seconds))
        self._seen[kind] += 1
        if self._seen[kind] % REFIT_EVERY:
            return
        median = sorted(s for _, s in periods)[len(periods) // 2]
        samples = [(t, s) for t, s in periods if s <= 3 * median]
        if len({t for t, _ in samples}) > 1:
            self.step_time[kind] = LinearStepTime.fit(samples)
        else:
            slope = self.step_time[kind].slope
            mean = sum(s for _, s in samples) / len(samples)
            self.step_time[kind] = LinearStepTime(mean - slope * samples[0][0], slope)

    def release(self, rid: str) -> None:
        """``rid`` ended: forget its proposer state and acceptance."""
        self.proposer.release(rid)
        self.tracker.release(rid)
        self._shadows.pop(rid, None)
