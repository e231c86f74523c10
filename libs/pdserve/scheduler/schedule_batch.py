"""``ScheduleBatch``: what one scheduling step runs, built fresh every step; ``StepOutput``: what
one request of it produced."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import cache

import torch

from pdserve.engine.forward_batch import ForwardBatch, ForwardMode
from pdserve.layers.pooler import PoolingRows, accumulate, finish
from pdserve.sampling.prompt_logprobs import PromptLogprobRows, chunk_targets
from pdserve.sampling.sampler import GenerationBatchResult
from pdserve.sampling.sampling_batch_info import SamplingBatchInfo
from pdserve.sampling.verify import Accepted, accept, verify_inputs
from pdserve.scheduler.req import Req

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one request produced in one step (or how it ended)."""

    req: Req
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False


@dataclass(eq=False)
class ScheduleBatch:
    """Requests of one step and how many tokens each computes.

    ``extend_lens[i]`` tokens of request ``i`` starting at position ``prefix_lens[i]`` are run; a
    decoding request has ``extend_len == 1`` (its last token). Extending requests come first, decoding
    ones after them. ``samples[i]`` says whether row ``i``'s sampled token counts (a decode, or the
    last chunk of a prompt) or is discarded (a non-final chunk).

    Speculative decoding: ``drafts[i]`` are the draft tokens decoding request ``i`` verifies after
    its last token (``extend_lens[i] == 1 + len(drafts[i])``; ``draft_probs[i]`` their ``q`` where
    sampled). A batch with drafts has logits at every token of a verifying request, sampled under
    ``pdserve.sampling.verify``'s rows, and its result per request is ``accepted()``. Such a batch
    is never followed by one scheduled before its result is processed (no request of it is
    *pending* in the next one).

    A batch may be scheduled before the result of the batch just before it (``prev``) is known (the
    overlap loop): then a decoding request's input token is the token ``prev`` samples for it, and
    ``pending`` lists ``(flat token index here, row of prev)`` pairs filled in by :meth:`resolve` on
    the forward thread, right before the forward, without a trip through Python lists.

    Attributes set while the batch lives: ``forward_batch`` (by :meth:`prepare`, on the scheduler's
    thread), ``result`` and ``row_errors`` (row -> error of a row whose forward failed; by the forward
    thread, see ``pdserve.scheduler.batch_runner``).
    """

    reqs: list[Req]
    extend_lens: list[int]
    num_extend: int  # the first num_extend reqs extend, the rest decode
    prefix_lens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    prev: ScheduleBatch | None = None
    pending: list[tuple[int, int]] = field(default_factory=list)
    forward_batch: ForwardBatch | None = None
    ready: torch.cuda.Event | None = None  # on CUDA: recorded once ``forward_batch`` is built
    result: GenerationBatchResult | None = None
    row_errors: dict[int, str] = field(default_factory=dict)
    drafts: list[list[int]] = field(default_factory=list)
    draft_probs: list | None = None
    # (flat token indices, rows of prev): int64 [len(pending)] each, on the device
    _pending_index: tuple[torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not self.prefix_lens:
            self.prefix_lens = [r.num_computed for r in self.reqs]
        if not self.samples:
            self.samples = [
                p + n >= r.seq_len
                for r, p, n in zip(self.reqs, self.prefix_lens, self.extend_lens, strict=True)
            ]

    @property
    def verifies(self) -> bool:
        """Whether some request of the batch verifies draft tokens."""
        return any(self.drafts)

    def accepted(self) -> list[Accepted]:
        """Per request, the tokens it keeps from ``result``: one sampled token, or for a verifying
        request its accepted drafts and the token after them, with their logprobs."""
        return accept(self.result, self.drafts or [[] for _ in self.reqs])

    def set_drafts(self) -> None:
        """Take each decoding request's drafts (``Req.drafts``, ``Req.draft_probs``) into the batch."""
        decoding = range(self.num_extend, len(self.reqs))
        if any(self.reqs[i].drafts for i in decoding):
            self.drafts = [list(r.drafts) if i in decoding else [] for i, r in enumerate(self.reqs)]
            self.draft_probs = [r.draft_probs if i in decoding else None for i, r in enumerate(self.reqs)]

    def row_drafts(self, i: int) -> list[int]:
        return self.drafts[i] if self.drafts else []

    @property
    def forward_mode(self) -> ForwardMode:
        if self.verifies:
            return ForwardMode.MIXED if self.num_extend else ForwardMode.TARGET_VERIFY
        if self.num_extend == len(self.reqs):
            return ForwardMode.EXTEND
        if self.num_extend == 0:
            return ForwardMode.DECODE
        return ForwardMode.MIXED

    def launch(self) -> list[Req]:
        """Advance every request's counters as if the batch had run (``num_computed``, ``in_batches``,
        ``last_row``, a sampling row's ``num_pending``), so that the next batch can be scheduled
        before this one's result is known. Returns the requests whose prompt's last chunk it runs."""
        last_chunks = []
        for i, req in enumerate(self.reqs):
            req.num_computed += self.extend_lens[i]
            req.in_batches += 1
            req.last_row = i
            if self.samples[i]:
                req.num_pending += 1
                if i < self.num_extend:
                    last_chunks.append(req)
        return last_chunks

    def token_logprob(self, i: int) -> tuple[float, list[tuple[int, float]]] | None:
        """Row ``i``'s sampled token's logprob and top logprobs, when the batch computed them."""
        result = self.result
        if result.next_token_logprobs is None:
            return None
        top = result.top_logprobs[i] if result.top_logprobs is not None else []
        return result.next_token_logprobs[i], top

    def row_token(self, i: int, kept: list[Accepted] | None) -> tuple[int, tuple | None]:
        """Row ``i``'s sampled token and its logprob (``kept``: ``accepted()`` when the batch verifies
        drafts, whose result then has a row per position)."""
        if kept is None:
            return self.result.next_token_ids[i], self.token_logprob(i)
        return kept[i].token_ids[0], kept[i].logprob(0)

    def take_prompt_outputs(self, i: int) -> None:
        """Add what row ``i``'s prompt chunk computed for its request: the prompt tokens it scored
        (``Req.prompt_logprobs``), and what it pooled (``Req.pooled``, ``pdserve.layers.pooler``),
        the ``embedding`` made on the prompt's last chunk. Nothing for a request that asked for
        neither."""
        req, scored, pooled = self.reqs[i], self.result.prompt_logprobs, self.result.pooled
        if scored is not None:
            req.prompt_logprobs += scored[i]
        if pooled is None or pooled[i] is None:
            return
        pooling = self.forward_batch.pooling.kinds[i]
        if self.prefix_lens[i] == 0:  # its prompt's first chunk (again, after a retraction)
            req.pooled = None
        req.pooled = accumulate(req.pooled, pooled[i], pooling)
        if self.samples[i]:
            req.embedding, req.pooled = finish(req.pooled, pooling, len(req.origin_input_ids)), None

    def is_last_chunk(self, i: int) -> bool:
        """True when step ``i`` completes the request's fill, so its sampled token counts."""
        return self.samples[i]

    def prepare(self, runner, prev: ScheduleBatch | None = None) -> None:
        """Build ``forward_batch``: ids, pool slots, lengths and sampling info (int64 tensors); the KV
        slots are read from ``req_to_token``, which the ledger wrote when it gave the pages.

        Call it before the requests' counters advance for this batch: a request with
        ``num_pending > 0`` decodes the token ``prev`` samples for it at its row ``last_row``.

        Raises whatever building the sampling tensors raises for a request's parameters
        (``prepare_batch`` then finds the request responsible).

        On CUDA the tensors are built on a side stream of the scheduler's thread, so that building
        them never waits for the forward running on the device; ``ready`` marks when they are.
        """
        stream = _side_stream(runner.device)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            self._build(runner, prev)
            if stream is not None:
                self.ready = torch.cuda.Event()
                self.ready.record(stream)

    def _build(self, runner, prev: ScheduleBatch | None) -> None:
        self.prev = prev
        input_ids: list[int] = []
        self.pending = []
        for i, (req, start, n) in enumerate(zip(self.reqs, self.prefix_lens, self.extend_lens, strict=True)):
            if self.row_drafts(i):  # its last token (never pending), then the drafts it verifies
                input_ids += [req.output_ids[-1], *self.drafts[i]]
            elif req.num_pending:  # a decode whose input is still being sampled by ``prev``
                self.pending.append((len(input_ids), req.last_row))
                input_ids.append(0)
            elif start + n <= len(req.origin_input_ids):
                input_ids.extend(req.origin_input_ids[start : start + n])
            elif n == 1:
                input_ids.append(req.output_ids[start - len(req.origin_input_ids)])
            else:
                input_ids.extend(req.fill_ids[start : start + n])
        if self.pending and prev is None:
            raise RuntimeError("a request with a pending token needs the batch that samples it")
        pending = torch.tensor(self.pending, dtype=torch.int64, device=runner.device)
        self._pending_index = pending.reshape(-1, 2).T.unbind(0)  # unpacked here, not on the forward thread
        params = [r.sampling_params for r in self.reqs]
        rows = dict(
            output_ids=[r.output_ids for r in self.reqs],
            prompt_ids=[r.origin_input_ids for r in self.reqs],
            eos_token_ids=runner.model_config.eos_token_ids,
            vocab_size=runner.model_config.vocab_size,
            device=runner.device,
            grammars=[r.grammar for r in self.reqs],
            output_lens=[r.num_generated for r in self.reqs],
        )
        logits_lens, draft_rows, top_logprobs_nums = None, None, [p.top_logprobs_num or 0 for p in params]
        if self.verifies:  # a sampling row per position of each verifying request
            inputs = verify_inputs(params, drafts=self.drafts, draft_probs=self.draft_probs, **rows)
            if inputs.drafts != self.drafts:
                raise RuntimeError("a grammar cut drafts after their KV slots were given")
            sampling_info, logits_lens = inputs.sampling_info, inputs.logits_lens
            draft_rows, top_logprobs_nums = inputs.draft_rows, inputs.top_logprobs_nums
        else:
            sampling_info = SamplingBatchInfo.build(params, **rows)
        prompt_rows = self._prompt_logprob_rows(logits_lens)
        pooling = runner.model_config.pooling
        kinds = [
            pooling if i < self.num_extend and r.embeds_prompt else None for i, r in enumerate(self.reqs)
        ]
        pooling_rows = PoolingRows(kinds) if any(kinds) else None
        prefix = torch.tensor(self.prefix_lens, dtype=torch.int64)
        extend = torch.tensor(self.extend_lens, dtype=torch.int64)
        self.forward_batch = ForwardBatch.init_new(
            forward_mode=self.forward_mode,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64),
            seq_lens=prefix + extend,
            extend_prefix_lens=prefix,
            extend_seq_lens=extend,
            sampling_info=sampling_info,
            return_logprob=any(p.return_logprob for p in params),
            top_logprobs_nums=top_logprobs_nums,
            logits_lens=logits_lens if prompt_rows is None else prompt_rows.logits_lens,
            draft_rows=draft_rows,
            runner=runner,
            prompt_logprobs=prompt_rows,
            pooling=pooling_rows,
            lora_slots=[r.lora_slot for r in self.reqs],
        )

    def _prompt_logprob_rows(self, logits_lens: list[int] | None) -> PromptLogprobRows | None:
        """Logits at every position of the chunks whose requests score their prompt, beside the
        other requests' rows (``logits_lens``: a verifying request's ``k + 1``; None: one each); None
        when none of the batch scores its prompt (``pdserve.sampling.prompt_logprobs``)."""
        scoring = [i for i, req in enumerate(self.reqs[: self.num_extend]) if req.scores_prompt]
        if not scoring:
            return None
        lens = list(logits_lens) if logits_lens is not None else [1] * len(self.reqs)
        targets: list[list[int]] = [[] for _ in self.reqs]
        tops: list[int | None] = [None] * len(self.reqs)
        for i in scoring:
            req = self.reqs[i]
            lens[i] = self.extend_lens[i]
            targets[i] = chunk_targets(req.origin_input_ids, self.prefix_lens[i], self.extend_lens[i])
            tops[i] = req.sampling_params.prompt_logprobs
        return PromptLogprobRows(lens, targets, tops)

    def resolve(self) -> None:
        """Fill the pending input ids from ``prev``'s sampled tokens (on the forward thread, once
        ``prev`` has run). Rows of ``prev`` that failed give token 0: their requests have failed, and
        what this batch computes for them is discarded."""
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)
        if not self.pending:
            return
        if self.prev is None or self.prev.result is None:
            raise RuntimeError("the previous batch produced no tokens to decode from")
        dst, src = self._pending_index
        self.forward_batch.input_ids[dst] = self.prev.result.next_token_tensor[src]
        self.prev = None  # free it: its tensors are not needed any more


def kv_written(req: Req, outstanding: list[ScheduleBatch]) -> int:
    """Tokens of ``req`` whose KV is in the pool now: ``num_computed`` less the tokens of the
    ``outstanding`` batches (scheduled, not processed yet: their forwards may still be writing them)."""
    n = req.num_computed
    if req.in_batches:
        for batch in outstanding:
            n -= sum(batch.extend_lens[i] for i, r in enumerate(batch.reqs) if r is req)
    return n


def prepare_batch(
    batch: ScheduleBatch, runner, prev: ScheduleBatch | None
) -> tuple[ScheduleBatch | None, list[tuple[Req, str]]]:
    """``batch.prepare(runner, prev)``, so that a request whose parameters make that raise fails alone:
    each request's inputs are then built on their own to find the ones responsible, and a batch of
    the others is built again.

    Returns:
        The batch to run (``batch``, or one of its requests less; None when none is left) and the
        requests that must fail, each with its error.
    """
    try:
        batch.prepare(runner, prev)
        return batch, []
    except Exception as e:  # narrowed to the requests responsible below
        logger.warning("building a batch of %d requests failed (%s): isolating", len(batch.reqs), e)
    keep, failed = [], []
    for i, req in enumerate(batch.reqs):
        try:
            _subset(batch, [i]).prepare(runner, prev)
            keep.append(i)
        except Exception as e:  # this request's inputs are the cause
            failed.append((req, f"invalid sampling inputs: {type(e).__name__}: {e}"))
    if not keep:
        return None, failed
    rest = _subset(batch, keep)
    try:
        rest.prepare(runner, prev)
    except Exception as e:  # no single request is the cause: fail the step's requests
        logger.exception("building a batch failed")
        error = f"building the batch failed: {type(e).__name__}: {e}"
        return None, failed + [(req, error) for req in rest.reqs]
    return rest, failed


def _subset(batch: ScheduleBatch, rows: list[int]) -> ScheduleBatch:
    """A batch of ``rows`` of ``batch`` (in order), with their drafts."""
    sub = ScheduleBatch(
        [batch.reqs[i] for i in rows],
        [batch.extend_lens[i] for i in rows],
        sum(i < batch.num_extend for i in rows),
        drafts=[batch.drafts[i] for i in rows] if batch.drafts else [],
    )
    if batch.draft_probs is not None:
        sub.draft_probs = [batch.draft_probs[i] for i in rows]
    return sub


@cache
def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream batches are built on (CUDA only; one per device)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None
