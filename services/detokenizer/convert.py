"""pdserve.v1 output messages <-> pdserve.detokenize steps and deltas."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from pdserve.detokenize import DecodeOptions, TextDelta, TokenStep
from pdserve.v1 import common_pb2, output_pb2, scheduler_pb2, scheduler_pb2_grpc


def decode_scheduler_stub(channel: grpc.aio.Channel) -> scheduler_pb2_grpc.DecodeSchedulerStub:
    """The client stub of a decode-scheduler (the detokenizer calls its ``Abort``)."""
    return scheduler_pb2_grpc.DecodeSchedulerStub(channel)


@dataclass(frozen=True, slots=True)
class Route:
    """Where a rid's outputs go, from its first TokenIDOutput (and its trace context, when traced)."""

    gateway_address: str
    scheduler_address: str
    index: int
    stream: int = 0  # the StreamTokenIDs call it arrived on
    traceparent: str = ""
    started: float = field(default_factory=time.time)


def is_first_output(out: output_pb2.TokenIDOutput) -> bool:
    """The first output of a rid is the one that carries its gateway address."""
    return bool(out.gateway_address)


def to_token_step(out: output_pb2.TokenIDOutput) -> TokenStep:
    options = None
    if is_first_output(out):
        options = DecodeOptions(
            skip_special_tokens=out.skip_special_tokens,
            spaces_between_special_tokens=out.spaces_between_special_tokens,
            stop=tuple(out.stop),
            include_stop_str_in_output=out.include_stop_str_in_output,
            min_new_tokens=out.min_new_tokens,
        )
    finish = out.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    return TokenStep(out.rid, out.token_ids, finish, options, out.resumed_output_ids)


def column_rows(batch: output_pb2.BatchTokenIDOutput) -> list[tuple[str, list[int], int]]:
    """The column rows of ``batch``: ``(rid, new ids, completion tokens)`` in order (see
    ``BatchTokenIDOutput``).

    Raises:
        ValueError: the columns disagree in length.
    """
    rids, counts, completion = batch.rids, batch.num_token_ids, batch.completion_tokens
    ids = list(batch.token_ids)
    if not len(rids) == len(counts) == len(completion) or sum(counts) != len(ids):
        raise ValueError("BatchTokenIDOutput columns disagree in length")
    rows, start = [], 0
    for rid, n, done in zip(rids, counts, completion, strict=True):
        rows.append((rid, ids[start : start + n], done))
        start += n
    return rows


class StrBatchBuilder:
    """Collects one step's rows for one gateway and builds their ``BatchStrOutput`` once: a row with
    only text and ids goes into the columns, anything else is a ``StrOutput``."""

    __slots__ = ("completion", "counts", "extras", "ids", "rids", "texts")

    def __init__(self) -> None:
        self.extras: list[output_pb2.StrOutput] = []
        self.rids: list[str] = []
        self.texts: list[str] = []
        self.counts: list[int] = []
        self.ids: list[int] = []
        self.completion: list[int] = []

    def add_column(self, rid: str, text: str, token_ids: list[int], completion_tokens: int) -> None:
        self.rids.append(rid)
        self.texts.append(text)
        self.counts.append(len(token_ids))
        self.ids.extend(token_ids)
        self.completion.append(completion_tokens)

    def build(self) -> output_pb2.BatchStrOutput:
        return output_pb2.BatchStrOutput(
            outputs=self.extras,
            rids=self.rids,
            text_deltas=self.texts,
            num_token_ids=self.counts,
            token_ids=self.ids,
            completion_tokens=self.completion,
        )


def to_route(out: output_pb2.TokenIDOutput, stream: int = 0) -> Route:
    return Route(out.gateway_address, out.scheduler_address, out.index, stream, out.traceparent)


def lost_output(rid: str, route: Route) -> output_pb2.StrOutput:
    """The last output of a rid whose scheduler's stream ended: a retryable error."""
    return output_pb2.StrOutput(
        rid=rid,
        finish_reason=common_pb2.FINISH_REASON_ERROR,
        error=f"decode worker {route.scheduler_address or '?'} went away (its output stream ended); retry",
        retryable=True,
        index=route.index,
        worker_lost=True,
    )


def to_str_output(out: output_pb2.TokenIDOutput, delta: TextDelta, index: int) -> output_pb2.StrOutput:
    """The StrOutput of one rid for one step; a stop-string match turns it into a STOP finish."""
    stopped = delta.matched_stop is not None
    return output_pb2.StrOutput(
        rid=out.rid,
        text_delta=delta.text,
        token_ids=out.token_ids,
        logprobs=out.logprobs,
        prompt_logprobs=out.prompt_logprobs,
        embedding=out.embedding,
        finish_reason=common_pb2.FINISH_REASON_STOP if stopped else out.finish_reason,
        matched_stop=delta.matched_stop or "",
        matched_stop_token=0 if stopped else out.matched_stop_token,
        error=out.error,
        retryable=out.retryable,
        prompt_tokens=out.prompt_tokens,
        cached_tokens=out.cached_tokens,
        completion_tokens=out.completion_tokens,
        index=index,
    )


def abort_request(rid: str, reason: str, stopped: bool) -> scheduler_pb2.AbortRequest:
    """``DecodeScheduler.Abort`` of ``rid``: counted as a stop (finish reason STOP) when ``stopped``."""
    finish = common_pb2.FINISH_REASON_STOP if stopped else common_pb2.FINISH_REASON_ABORT
    return scheduler_pb2.AbortRequest(rid=rid, reason=reason, finish_reason=finish)
