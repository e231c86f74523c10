"""``Req``: one generation request as the scheduler holds it across many steps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.constrained.grammar import Grammar
from pdserve.sampling.prompt_logprobs import PromptLogprob
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.route import Route


class ReqState(enum.Enum):
    """Lifecycle: WAITING → (PREFILLING | WAITING_FOR_KV) → RUNNING → FINISHED | ABORTED | FAILED.

    A retracted request goes from RUNNING back to WAITING with the tokens it already generated.
    In the prefill role a request ends in FINISHED right after its first token (and KV write).
    """

    WAITING = "waiting"
    PREFILLING = "prefilling"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (ReqState.FINISHED, ReqState.ABORTED, ReqState.FAILED)


_ALLOWED = {
    ReqState.WAITING: {ReqState.PREFILLING, ReqState.WAITING_FOR_KV, ReqState.ABORTED, ReqState.FAILED},
    ReqState.PREFILLING: {ReqState.RUNNING, ReqState.FINISHED, ReqState.ABORTED, ReqState.FAILED},
    ReqState.WAITING_FOR_KV: {ReqState.RUNNING, ReqState.WAITING, ReqState.ABORTED, ReqState.FAILED},
    ReqState.RUNNING: {ReqState.WAITING, ReqState.FINISHED, ReqState.ABORTED, ReqState.FAILED},
}


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(eq=False)
class Req:
    """A request's long-lived scheduling state.

    KV bookkeeping: ``pages`` are the KV page indices backing positions
    ``[0, len(pages) * page_size)`` of ``fill_ids``; the first ``num_prefix_pages`` of them came from
    the radix cache (locked through ``last_node``), the rest are owned by this request.
    ``num_computed`` tokens of the request have KV in the pool once the batches it is in have run: it
    advances when a batch is scheduled, not when its result comes back.

    Overlap bookkeeping: ``num_pending`` tokens have been sampled by scheduled batches whose results
    are not processed yet (so the request's sequence is ``fill_ids`` plus that many unknown tokens);
    ``in_batches`` counts those batches, and ``last_row`` is the request's row in the latest one. A
    request that ends while ``in_batches > 0`` keeps its KV (pages, request slot, cache locks) until
    the last of those batches is processed: a forward may still read and write it.
    """

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    # KV ledger
    req_pool_idx: int | None = None
    pages: list[int] = field(default_factory=list)
    num_prefix_pages: int = 0
    last_node: Any = None
    num_computed: int = 0
    lora_slot: int = -1  # its LoRA adapter's slot while admitted (pinned; -1: the base model)
    # accounting
    cached_tokens: int = 0
    output_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    # prompt tokens 1.. scored so far (``sampling_params.prompt_logprobs``), sent with the first output
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    # ``sampling_params.embed``: what its prompt's chunks pooled so far (float32 [H]), then the
    # L2-normalised embedding, sent with the first output (``pdserve.layers.pooler``)
    pooled: Any = None
    embedding: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop_token: int | None = None
    error: str = ""
    retryable: bool = False  # an ERROR caused by the server's state (overload, a hung worker): retry
    # where it came from and where its KV and outputs go (the servicer's, carried opaquely)
    route: Route = field(default_factory=Route)
    deadline: float = 0.0
    span: Any = None  # its tracing span, on the rank that serves its RPC (never sent to other ranks)
    # timing (time.time() seconds)
    arrival_time: float = field(default_factory=time.time)
    admit_time: float = 0.0
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    finish_time: float = 0.0
    # set when an abort arrives while the request is inside a running forward, with what it ends as
    to_abort: str = ""
    abort_as: FinishReason = FinishReason.ABORT
    # its grammar's matcher, once compiled (None for an unconstrained request)
    grammar: Grammar | None = None
    # overlap bookkeeping (see the class docstring)
    num_pending: int = 0
    in_batches: int = 0
    last_row: int = -1
    release_cache: bool | None = None  # a release deferred until in_batches drops to 0: cache its KV?
    # speculative decoding: the draft tokens its latest scheduled step verifies after its last token
    # (and, where the proposer sampled them, their distributions ``q``: float32 [len(drafts), V])
    drafts: list[int] = field(default_factory=list)
    draft_probs: Any = None

    @property
    def fill_ids(self) -> list[int]:
        """Prompt plus generated tokens: what a (re-)extend must have KV for."""
        return self.origin_input_ids + self.output_ids

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's extend must return prompt logprobs: asked for, and not yet computed (a
        request retracted after its first token extends again without them)."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_ids

    @property
    def computes_whole_prompt(self) -> bool:
        """Its prompt's extend must compute every position, not a cached prefix's: it scores its
        prompt, or it embeds it (a mean pools every position's hidden state)."""
        return self.scores_prompt or self.embeds_prompt

    @property
    def embeds_prompt(self) -> bool:
        """Its prompt's extend must pool an embedding (``sampling_params.embed``), not yet made."""
        return self.sampling_params.embed and not self.output_ids

    @property
    def seq_len(self) -> int:
        """Tokens of the sequence, the ``num_pending`` not yet known ones included."""
        return len(self.origin_input_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        """Output tokens, the ``num_pending`` not yet known ones included."""
        return len(self.output_ids) + self.num_pending

    def append_token(
        self, token: int, logprob: tuple[float, list[tuple[int, float]]] | None, now: float
    ) -> None:
        """Append a sampled ``token`` (its logprob and top logprobs, if asked for) at time ``now``; a
        constrained request's matcher advances by it (a refusal fails the request in
        ``check_finished``)."""
        self.output_ids.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)
        if logprob is not None:
            self.output_logprobs.append((token, logprob[0], logprob[1]))
        if self.first_token_time == 0.0:
            self.first_token_time = now
        self.last_token_time = now

    def will_finish_by_length(self, context_len: int) -> bool:
        """Whether the pending tokens already bring it to ``max_new_tokens`` or ``context_len``: then it
        ends when they arrive, whatever they are, and needs no further step."""
        n = self.num_generated
        return n >= self.sampling_params.max_new_tokens or len(self.origin_input_ids) + n >= context_len

    def set_state(self, new: ReqState) -> None:
        """Move to ``new``; raises RuntimeError on a transition the lifecycle does not allow."""
        if new not in _ALLOWED.get(self.state, ()):
            raise RuntimeError(f"rid {self.rid}: illegal state change {self.state.value} -> {new.value}")
        self.state = new

    def finish(self, reason: FinishReason, error: str = "") -> None:
        target = {
            FinishReason.STOP: ReqState.FINISHED,
            FinishReason.LENGTH: ReqState.FINISHED,
            FinishReason.ABORT: ReqState.ABORTED,
            FinishReason.ERROR: ReqState.FAILED,
        }[reason]
        self.set_state(target)
        self.finish_reason = reason
        self.error = error

    def check_finished(self, eos_token_ids: list[int], context_len: int) -> None:
        """After a new token: finish with STOP (EOS / stop token) or LENGTH when due.

        A constrained request also finishes with STOP once its grammar has ended (it accepted EOS,
        even before ``min_new_tokens``: nothing may follow), and fails if its grammar refused the
        token.
        """
        params = self.sampling_params
        last = self.output_ids[-1]
        n = len(self.output_ids)
        if self.grammar is not None:
            if self.grammar.rejected is not None:
                self.finish(
                    FinishReason.ERROR, f"token {self.grammar.rejected} is not allowed by the grammar"
                )
                return
            if self.grammar.terminated:
                self.matched_stop_token = last
                self.finish(FinishReason.STOP)
                return
        if n >= (params.min_new_tokens or 0):
            if last in (params.stop_token_ids or ()):
                self.matched_stop_token = last
                self.finish(FinishReason.STOP)
                return
            if not params.ignore_eos and last in eos_token_ids:
                self.matched_stop_token = last
                self.finish(FinishReason.STOP)
                return
        if n >= params.max_new_tokens or len(self.origin_input_ids) + n >= context_len:
            self.finish(FinishReason.LENGTH)
