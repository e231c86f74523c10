"""Conversions between the scheduler services' protobuf messages and the transport-free domain
objects: the only module of services/common, prefill and decode (beside their servicers) that
touches generated code."""

from __future__ import annotations

import dataclasses
import time
import uuid

from pdserve.constrained import GRAMMAR_KINDS
from pdserve.kv_transfer import KVAgentInfo, KVLayout
from pdserve.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from pdserve.observability import tracing
from pdserve.sampling.prompt_logprobs import PromptLogprob
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.metrics import SchedulerLoad
from pdserve.scheduler.req import FinishReason, Req
from pdserve.scheduler.route import Route
from pdserve.services.common.events import KVReady
from pdserve.v1 import common_pb2, output_pb2, scheduler_pb2

# the process's identity in GetLoad: the gateway fails what it routed to an earlier incarnation
INCARNATION = uuid.uuid4().hex

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
    "speculative_num_draft_tokens",
    "prompt_logprobs",
    *GRAMMAR_KINDS,
)
_PLAIN_FIELDS = (
    "ignore_eos",
    "include_stop_str_in_output",
    "spaces_between_special_tokens",
    "return_logprob",
    "top_logprobs_num",
    "priority",
    "embed",
    "lora_name",
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


def generate_req_from_pb(pb: scheduler_pb2.TokenizedGenerateReqInput, scheduler_address: str) -> Req:
    """A decode (or mixed) worker's request, routed as the gateway says; ``scheduler_address`` is
    this worker's own (the detokenizer aborts there on a stop string). A migrated request's
    continuation starts with its ``resumed_output_ids`` as output ids, as a retracted request does.

    Raises:
        TypeError: a sampling parameter the engine does not take (``sampling_params_from_pb``).
    """
    route = Route(
        prefill_address=pb.prefill_address,
        fallback_prefill_addresses=tuple(pb.fallback_prefill_addresses),
        output_address=pb.output_address,
        gateway_address=pb.gateway_address,
        scheduler_address=scheduler_address,
    )
    return Req(
        rid=pb.rid,
        origin_input_ids=list(pb.input_ids),
        output_ids=list(pb.resumed_output_ids),
        sampling_params=sampling_params_from_pb(pb.sampling_params),
        deadline=pb.deadline_unix_s,
        arrival_time=pb.arrival_unix_s or time.time(),
        route=route,
    )


def prefill_req_from_pb(pb: scheduler_pb2.PrefillRequest) -> Req:
    """A prefill worker's request: the decode worker's prompt (its last ``num_output_ids`` ids were
    generated already, by a request retracted there) and where its KV goes.

    Raises:
        TypeError: a sampling parameter the engine does not take (``sampling_params_from_pb``).
    """
    ids = list(pb.input_ids)
    generated = min(max(pb.num_output_ids, 0), max(len(ids) - 1, 0))
    route = Route(
        kv_dst_agent=pb.dst_agent_name,
        kv_dst_pages=tuple(pb.dst_page_indices),
        kv_dst_start_page=pb.dst_start_page,
        kv_dst_local_pages=tuple(pb.dst_local_page_indices),
        kv_transfer_id=(pb.kv_transfer_id or pb.rid).encode(),
    )
    return Req(
        rid=pb.rid,
        origin_input_ids=ids[: len(ids) - generated],
        output_ids=ids[len(ids) - generated :],
        sampling_params=sampling_params_from_pb(pb.sampling_params),
        deadline=pb.deadline_unix_s,
        route=route,
    )


def prefill_request_to_pb(
    req: Req, tid: bytes, dst: KVAgentInfo, local_pages: list[int]
) -> scheduler_pb2.PrefillRequest:
    """Ask a prefill worker for ``req``'s prompt KV, written as transfer ``tid`` into the pages of
    ``req`` the radix cache did not give (agent ``dst``'s pool) and, with an SWA pool, into
    ``local_pages`` (``KVLedger.arriving_local_pages``)."""
    return scheduler_pb2.PrefillRequest(
        rid=req.rid,
        input_ids=req.fill_ids,
        sampling_params=sampling_params_to_pb(req.sampling_params),
        dst_agent_name=dst.agent_name,
        dst_incarnation=dst.incarnation,
        dst_page_indices=req.pages[req.num_prefix_pages :],
        dst_start_page=req.num_prefix_pages,
        deadline_unix_s=req.deadline,
        num_output_ids=len(req.output_ids),
        kv_transfer_id=tid.decode(),
        dst_local_page_indices=local_pages,
    )


def prefill_response_to_pb(req: Req, transferred_bytes: int) -> scheduler_pb2.PrefillResponse:
    """A prefilled request's first token (its last output id) and its logprob, if asked for."""
    response = scheduler_pb2.PrefillResponse(
        rid=req.rid,
        first_token_id=req.output_ids[-1],
        cached_tokens=req.cached_tokens,
        transferred_bytes=transferred_bytes,
    )
    if req.output_logprobs:
        token, logprob, top = req.output_logprobs[-1]
        response.first_logprob.CopyFrom(token_logprob_to_pb(token, logprob, top))
    response.prompt_logprobs.extend(token_logprob_to_pb(*lp) for lp in req.prompt_logprobs)
    response.embedding.extend(req.embedding)
    return response


def kv_ready_from_pb(rid: str, pb: scheduler_pb2.PrefillResponse) -> KVReady:
    """The prefill worker's answer for ``rid``: its first token, once its KV is written."""
    logprob = None
    if pb.HasField("first_logprob"):
        lp = pb.first_logprob
        logprob = (lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
    prompt = [token_logprob_from_pb(lp) for lp in pb.prompt_logprobs]
    return KVReady(
        rid, pb.first_token_id, logprob, pb.cached_tokens, pb.transferred_bytes, prompt, list(pb.embedding)
    )


def finish_reason_from_pb(value: int) -> FinishReason:
    """The finish an Abort asks for: STOP for a stop string the detokenizer matched, else ABORT."""
    return FinishReason.STOP if value == common_pb2.FINISH_REASON_STOP else FinishReason.ABORT


def load_to_pb(load: SchedulerLoad) -> common_pb2.LoadInfo:
    """The scheduler's load and limits, with this process's incarnation (``GetLoad``)."""
    return common_pb2.LoadInfo(**dataclasses.asdict(load), incarnation=INCARNATION)


def abort_request_to_pb(rid: str, reason: str) -> scheduler_pb2.AbortRequest:
    return scheduler_pb2.AbortRequest(rid=rid, reason=reason)


def metrics_to_pb(role: str, worker: str, text: str) -> common_pb2.MetricsResponse:
    return common_pb2.MetricsResponse(role=role, worker=worker, text=text)


def token_logprob_to_pb(
    token: int, logprob: float, top: list[tuple[int, float]], rank: int = 0
) -> common_pb2.TokenLogprob:
    """A token's logprob, its top alternatives and (a prompt token's, ``PromptLogprob``) its rank."""
    return common_pb2.TokenLogprob(
        token_id=token,
        logprob=logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
        rank=rank,
    )


def token_logprob_from_pb(pb: common_pb2.TokenLogprob) -> PromptLogprob:
    """A prompt token's ``PromptLogprob`` (what a prefill worker sent)."""
    return pb.token_id, pb.logprob, [(t.token_id, t.logprob) for t in pb.top], pb.rank


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
    """One request's share of a BatchTokenIDOutput; ``first`` adds what the detokenizer keeps (a
    continuation's resumed output ids among it: the output ids before this output's)."""
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
    )
    if finished and req.matched_stop_token is not None:
        out.matched_stop_token = req.matched_stop_token
    if params.return_logprob and new_token_ids:
        for token, logprob, top in req.output_logprobs[-len(new_token_ids) :]:
            out.logprobs.append(token_logprob_to_pb(token, logprob, top))
    if first:
        out.gateway_address = req.route.gateway_address
        out.scheduler_address = req.route.scheduler_address
        out.skip_special_tokens = params.skip_special_tokens is not False
        out.spaces_between_special_tokens = bool(params.spaces_between_special_tokens)
        out.stop.extend(params.stop or [])
        out.include_stop_str_in_output = bool(params.include_stop_str_in_output)
        out.min_new_tokens = params.min_new_tokens or 0
        out.traceparent = tracing.traceparent(req)
        out.prompt_logprobs.extend(token_logprob_to_pb(*lp) for lp in req.prompt_logprobs)
        out.embedding.extend(req.embedding)
        out.resumed_output_ids.extend(req.output_ids[: len(req.output_ids) - len(new_token_ids)])
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


def kv_rank_agents_to_pb(infos: list[KVAgentInfo]) -> scheduler_pb2.KVAgentInfo:
    """A handshake message: rank 0's agent, with the other ranks' (rank order) in ``tp_rank_agents``."""
    pb = kv_agent_info_to_pb(infos[0])
    pb.tp_rank_agents.extend(kv_agent_info_to_pb(info) for info in infos[1:])
    return pb


def kv_rank_agents_from_pb(pb: scheduler_pb2.KVAgentInfo) -> list[KVAgentInfo]:
    """Every rank's agent of a handshake message, rank order (one for a scheduler without TP)."""
    return [kv_agent_info_from_pb(pb), *(kv_agent_info_from_pb(rank) for rank in pb.tp_rank_agents)]


def kv_event_to_pb(event: KVEvent) -> scheduler_pb2.KVEvent:
    if isinstance(event, BlockStored):
        stored = scheduler_pb2.BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            medium=event.medium,
        )
        return scheduler_pb2.KVEvent(block_stored=stored)
    if isinstance(event, BlockRemoved):
        removed = scheduler_pb2.BlockRemoved(block_hashes=event.block_hashes, medium=event.medium)
        return scheduler_pb2.KVEvent(block_removed=removed)
    if isinstance(event, AllBlocksCleared):
        return scheduler_pb2.KVEvent(all_blocks_cleared=scheduler_pb2.AllBlocksCleared())
    raise TypeError(f"not a KV event: {event!r}")


def kv_event_batch_to_pb(batch: KVEventBatch) -> scheduler_pb2.KVEventBatch:
    return scheduler_pb2.KVEventBatch(
        seq=batch.seq,
        timestamp_unix_s=batch.timestamp,
        events=[kv_event_to_pb(event) for event in batch.events],
        snapshot=batch.snapshot,
        incarnation=INCARNATION,
    )


def lora_adapter_response_to_pb() -> scheduler_pb2.LoraAdapterResponse:
    return scheduler_pb2.LoraAdapterResponse()


def flush_cache_response_to_pb(flushed: bool) -> scheduler_pb2.FlushCacheResponse:
    message = "radix cache flushed" if flushed else "requests are held: the radix cache was not flushed"
    return scheduler_pb2.FlushCacheResponse(flushed=flushed, message=message)
