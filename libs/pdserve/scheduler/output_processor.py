"""``OutputProcessor``: a processed step's sampled tokens applied to its requests (SGLang's
``scheduler_output_processor_mixin``).

Each row of a batch whose forward ran is, by what it computed: a non-final prompt chunk (its sample
discarded, its computed pages cached), a prompt's last chunk or a decode (one token), or a verify
row (the accepted drafts and the token after them, its KV rolled back to what was kept first). A
token is appended, timed, and checked against the request's finish conditions one at a time, so an
EOS, stop token or ``max_new_tokens`` inside an accepted run ends the request there.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.sampling.verify import Accepted
from pdserve.scheduler.decode import DecodeManager
from pdserve.scheduler.handoff import HandOff
from pdserve.scheduler.kv_ledger import KVLedger
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.scheduler.req import FinishReason, Req
from pdserve.scheduler.schedule_batch import ScheduleBatch, StepOutput
from pdserve.scheduler.speculator import Speculator
from pdserve.scheduler.table import RequestTable


class OutputProcessor:
    """Applies sampled tokens to the requests of one scheduler.

    Args:
        reqs: the request table (ends requests).
        ledger: caches and truncates their pages.
        decode: the decode stage (or the prefill role's ``HandOff``), told of requests that start
            decoding and asked which it hands on.
        speculator: observes each verify row's acceptance, or None.
        metrics: token timings and generated-token counts.
        eos_token_ids: the model's end-of-sequence ids.
        max_req_tokens: a request ends with "length" at this many tokens.
        clock: the scheduler's clock (seconds).
    """

    def __init__(
        self,
        reqs: RequestTable,
        ledger: KVLedger,
        decode: DecodeManager | HandOff,
        speculator: Speculator | None,
        metrics: SchedulerMetrics,
        eos_token_ids: list[int],
        max_req_tokens: int,
        clock: Callable[[], float],
    ) -> None:
        self.reqs, self.ledger, self.decode, self.speculator = reqs, ledger, decode, speculator
        self.metrics, self.eos_token_ids = metrics, eos_token_ids
        self.max_req_tokens, self.clock = max_req_tokens, clock

    def process(self, batch: ScheduleBatch) -> list[StepOutput]:
        """Apply the result of ``batch`` (taken out of the outstanding batches) to each of its rows;
        returns the outputs of the rows that produced tokens or ended."""
        now = self.clock()
        outputs: list[StepOutput] = []
        generated = 0
        # (failed rows' samples are zeros, never read; with every row failed there are none at all)
        survived = len(batch.row_errors) < len(batch.reqs)
        kept = batch.accepted() if batch.verifies and survived else None
        if self.speculator is not None:
            self.speculator.step_processed(batch)
        for i, req in enumerate(batch.reqs):
            req.in_batches -= 1
            req.num_pending -= batch.samples[i]
            if req.state.done:  # ended while this batch ran: only its KV was waiting for it
                self.ledger.release_deferred(req)
            elif req.to_abort or i in batch.row_errors:
                reason = req.abort_as if req.to_abort else FinishReason.ERROR
                self.reqs.end(req, reason, req.to_abort or batch.row_errors[i])
                outputs.append(StepOutput(req, finished=True))
            elif not batch.samples[i]:  # a non-final chunk of a long prompt: its sample is discarded
                batch.take_prompt_outputs(i)
                self.ledger.cache_unfinished(req)
            elif batch.row_drafts(i):  # a verify row: its accepted drafts and the token after them
                generated += len(kept[i].token_ids)
                outputs.append(self._verified(req, batch.row_drafts(i), kept[i], now))
            else:
                batch.take_prompt_outputs(i)
                token, logprob = batch.row_token(i, kept)
                self._append_token(req, token, logprob, now)
                generated += 1
                if i < batch.num_extend:
                    self.ledger.cache_unfinished(req)
                    if self.decode.hands_on(req):
                        continue
                outputs.append(self._check_finished(req, [token]))
        self.metrics.generation_tokens.inc(generated)
        return outputs

    def first_token(self, req: Req, token: int, logprob) -> StepOutput:
        """Decode role: ``req``'s KV came from a prefill worker, with its first token."""
        self._append_token(req, token, logprob, self.clock())
        self.metrics.generation_tokens.inc()
        self.decode.start(req)
        return self._check_finished(req, [token])

    def _verified(self, req: Req, drafts: list[int], kept: Accepted, now: float) -> StepOutput:
        """A verify step's result for ``req``: its KV kept for its last token and the accepted drafts
        only (``KVLedger.truncate``, before anything caches it), then the kept tokens appended one by
        one until one finishes it (EOS, stop token, length, its grammar's end)."""
        self.ledger.truncate(req, len(req.fill_ids) + kept.num_accepted_drafts)
        self.speculator.observe(req, len(drafts), kept.num_accepted_drafts)
        for j, token in enumerate(kept.token_ids):
            self._append_token(req, token, kept.logprob(j), now)
            out = self._check_finished(req, kept.token_ids[: j + 1])
            if out.finished:
                break
        return out

    def _append_token(self, req: Req, token: int, logprob, now: float) -> None:
        self.metrics.observe_token(req, now)
        req.append_token(token, logprob, now)

    def _check_finished(self, req: Req, new_token_ids: list[int]) -> StepOutput:
        """After ``req``'s new tokens: end it if they finish it (EOS, stop token, length)."""
        req.check_finished(self.eos_token_ids, self.max_req_tokens)
        if req.state.done:
            self.reqs.end(req, req.finish_reason)
        return StepOutput(req, new_token_ids, finished=req.state.done)
