"""Conversions between protobuf messages and the transport-free domain objects."""

from __future__ import annotations

import dataclasses

from pdserve.constrained import GRAMMAR_KINDS
from pdserve.kv_transfer import KVAgentInfo, KVLayout
from pdserve.observability import tracing
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.req import FinishReason, Req
from pdserve.v1 import common_pb2, output_pb2, scheduler_pb2

_OPTIONAL_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "max_new_tokens",
    "min_new_tokens",
    "seed",
    "skip_special_tokens",
    *GRAMMAR_KINDS,
)
_PLAIN_FIELDS = (
    "ignore_eos",
    "include_stop_str_in_output",
    "spaces_between_special_tokens",
    "return_logprob",
    "top_logprobs_num",
)


def sampling_params_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields keep the engine defaults. Values are checked where the request is queued
    (``Scheduler.add_request``, which knows the vocabulary)."""
    kwargs = {name: getattr(pb, name) for name in _OPTIONAL_FIELDS if pb.HasField(name)}
    kwargs.update({name: getattr(pb, name) for name in _PLAIN_FIELDS})
    kwargs["stop_token_ids"] = list(pb.stop_token_ids)
    kwargs["stop"] = list(pb.stop)
    kwargs["logit_bias"] = dict(pb.logit_bias)
    if pb.n:
        kwargs["n"] = pb.n
    return SamplingParams(**kwargs)


def sampling_params_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    """Every engine field has a proto field of the same name; ``None`` (no seed) stays unset."""
    return common_pb2.SamplingParams(**{k: v for k, v in dataclasses.asdict(p).items() if v is not None})


def token_logprob_to_pb(token: int, logprob: float, top: list[tuple[int, float]]) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=token,
        logprob=logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
    )


_FINISH = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}


def token_output_to_pb(
    req: Req, new_token_ids: list[int], finished: bool, first: bool
) -> output_pb2.TokenIDOutput:
    """One request's share of a BatchTokenIDOutput; ``first`` adds what the detokenizer keeps."""
    params = req.sampling_params
    out = output_pb2.TokenIDOutput(
        rid=req.rid,
        token_ids=new_token_ids,
        finish_reason=_FINISH[req.finish_reason] if finished else common_pb2.FINISH_REASON_UNSPECIFIED,
        error=req.error if finished else "",
        retryable=req.retryable if finished else False,
        prompt_tokens=len(req.origin_input_ids),
        cached_tokens=req.cached_tokens,
        completion_tokens=len(req.output_ids),
        index=req.meta.get("index", 0),
    )
    if finished and req.matched_stop_token is not None:
        out.matched_stop_token = req.matched_stop_token
    if params.return_logprob and new_token_ids:
        for token, logprob, top in req.output_logprobs[-len(new_token_ids) :]:
            out.logprobs.append(token_logprob_to_pb(token, logprob, top))
    if first:
        out.gateway_address = req.meta.get("gateway_address", "")
        out.scheduler_address = req.meta.get("scheduler_address", "")
        out.skip_special_tokens = params.skip_special_tokens is not False
        out.spaces_between_special_tokens = bool(params.spaces_between_special_tokens)
        out.stop.extend(params.stop or [])
        out.include_stop_str_in_output = bool(params.include_stop_str_in_output)
        out.min_new_tokens = params.min_new_tokens or 0
        out.traceparent = tracing.traceparent(req)
    return out


class TokenIDBatchBuilder:
    """Collects one step's rows for one detokenizer and builds their ``BatchTokenIDOutput`` once.

    A row with nothing but new ids goes into the columns; a request's first or last output, or one
    with logprobs, becomes a ``TokenIDOutput`` (``token_output_to_pb``).
    """

    __slots__ = ("completion", "counts", "extras", "ids", "rids")

    def __init__(self) -> None:
        self.extras: list[output_pb2.TokenIDOutput] = []
        self.rids: list[str] = []
        self.counts: list[int] = []
        self.ids: list[int] = []
        self.completion: list[int] = []

    def add(self, req: Req, new_token_ids: list[int], finished: bool, first: bool) -> None:
        if first or finished or (new_token_ids and req.sampling_params.return_logprob):
            self.extras.append(token_output_to_pb(req, new_token_ids, finished, first))
            return
        self.rids.append(req.rid)
        self.counts.append(len(new_token_ids))
        self.ids.extend(new_token_ids)
        self.completion.append(len(req.output_ids))

    def build(self) -> output_pb2.BatchTokenIDOutput:
        return output_pb2.BatchTokenIDOutput(
            outputs=self.extras,
            rids=self.rids,
            num_token_ids=self.counts,
            token_ids=self.ids,
            completion_tokens=self.completion,
        )


def kv_layout_to_pb(layout: KVLayout) -> scheduler_pb2.KVLayout:
    return scheduler_pb2.KVLayout(**vars(layout))


def kv_agent_info_to_pb(info: KVAgentInfo) -> scheduler_pb2.KVAgentInfo:
    fields = dict(vars(info))
    fields["layout"] = kv_layout_to_pb(info.layout)
    return scheduler_pb2.KVAgentInfo(**fields)


def kv_agent_info_from_pb(pb: scheduler_pb2.KVAgentInfo) -> KVAgentInfo:
    layout = KVLayout(
        **{f.name: getattr(pb.layout, f.name) for f in scheduler_pb2.KVLayout.DESCRIPTOR.fields}
    )
    fields = {f.name: getattr(pb, f.name) for f in scheduler_pb2.KVAgentInfo.DESCRIPTOR.fields}
    fields["layout"] = layout
    del fields["tp_rank_agents"]  # the handshake's other ranks: ``kv_rank_agents_from_pb``
    return KVAgentInfo(**fields)


def kv_rank_agents_from_pb(pb: scheduler_pb2.KVAgentInfo) -> list[KVAgentInfo]:
    """Every rank's agent of a handshake message, rank order (one for a scheduler without TP)."""
    return [kv_agent_info_from_pb(pb), *(kv_agent_info_from_pb(rank) for rank in pb.tp_rank_agents)]
