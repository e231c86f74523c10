"""``Req``: one generation request as the scheduler holds it across many steps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.sampling.sampling_params import SamplingParams


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
    ``num_computed`` tokens of ``fill_ids`` have KV in the pool.
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
    # accounting
    cached_tokens: int = 0
    output_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop_token: int | None = None
    error: str = ""
    retryable: bool = False  # an ERROR caused by the server's state (overload, a hung worker): retry
    # transport facts the servicer needs, carried opaquely
    meta: dict[str, Any] = field(default_factory=dict)
    deadline: float = 0.0
    # timing (time.time() seconds)
    arrival_time: float = field(default_factory=time.time)
    admit_time: float = 0.0
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    # set when an abort arrives while the request is inside a running forward
    to_abort: str = ""

    @property
    def fill_ids(self) -> list[int]:
        """Prompt plus generated tokens: what a (re-)extend must have KV for."""
        return self.origin_input_ids + self.output_ids

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
        """After a new token: finish with STOP (EOS / stop token) or LENGTH when due."""
        params = self.sampling_params
        last = self.output_ids[-1]
        n = len(self.output_ids)
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
