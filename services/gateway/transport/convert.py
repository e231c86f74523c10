"""Conversions between the gateway's ``io_struct`` objects and the ``pdserve.v1`` protobuf messages."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2_grpc

from pdserve.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from pdserve.services.gateway.errors import invalid_request
from pdserve.services.gateway.io_struct import (
    ChatPrompt,
    ChoiceDelta,
    ModelInfo,
    Prompt,
    SamplingParams,
    TokenizedPrompt,
    TokenLogprob,
    TokenPiece,
    TopLogprob,
    WorkerLoad,
)
from pdserve.v1 import (
    api_pb2,
    common_pb2,
    output_pb2,
    output_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

_FINISH_FROM_PB = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}
_FINISH_TO_PB = {v: k for k, v in _FINISH_FROM_PB.items()}

# the client stub of each backend the gateway calls, by kind (``BackendClients``)
STUBS = {
    "tokenizer": tokenizer_pb2_grpc.TokenizerStub,
    "decode": scheduler_pb2_grpc.DecodeSchedulerStub,
    "prefill": scheduler_pb2_grpc.PrefillSchedulerStub,
    "detokenizer": output_pb2_grpc.DetokenizerStub,
    "health": health_pb2_grpc.HealthStub,
}

# the gRPC service a scheduler reports NOT_SERVING while it drains (the server as a whole stays SERVING)
SCHEDULER_SERVICES = {
    "decode": scheduler_pb2.DESCRIPTOR.services_by_name["DecodeScheduler"].full_name,
    "prefill": scheduler_pb2.DESCRIPTOR.services_by_name["PrefillScheduler"].full_name,
}


def sampling_params_to_pb(sp: SamplingParams) -> common_pb2.SamplingParams:
    fields = {k: v for k, v in dataclasses.asdict(sp).items() if v is not None}
    return common_pb2.SamplingParams(**fields)


# 64-bit integer fields, which protobuf's JSON mapping writes as strings
_INT64_FIELDS = frozenset(
    f.name
    for f in common_pb2.SamplingParams.DESCRIPTOR.fields
    if f.cpp_type in (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)
)


def sampling_params_dict(pb: common_pb2.SamplingParams) -> dict[str, Any]:
    """The fields set in ``pb`` as the JSON body's dict, keyed by proto field names (unset optionals
    left out); 64-bit integers stay integers (the request models' types are strict)."""
    fields = MessageToDict(pb, preserving_proto_field_name=True)
    for name in fields.keys() & _INT64_FIELDS:
        fields[name] = getattr(pb, name)
    return fields


def tokenize_request(prompt: Prompt, add_special_tokens: bool) -> tokenizer_pb2.TokenizeRequest:
    """``Tokenizer.Tokenize`` input for a text or chat prompt (token-id prompts need no call)."""
    if isinstance(prompt, ChatPrompt):
        chat = tokenizer_pb2.ChatMessages(
            messages=[tokenizer_pb2.ChatMessage(**m) for m in prompt.messages],
            add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message,
            tools_json=prompt.tools_json,
            chat_template_kwargs_json=prompt.chat_template_kwargs_json,
        )
        return tokenizer_pb2.TokenizeRequest(chat=chat, add_special_tokens=add_special_tokens)
    return tokenizer_pb2.TokenizeRequest(text=prompt, add_special_tokens=add_special_tokens)


def chat_fields(chat: tokenizer_pb2.ChatMessages) -> dict[str, Any]:
    """``chat`` as the JSON fields of /v1/chat/completions (tools with ``tool_choice='none'``, the
    only choice this API has: it returns text, never parsed tool calls).

    Raises:
        GatewayError: 400 when ``tools_json``, ``chat_template_kwargs_json`` or a message's
            ``tool_calls_json`` is not JSON.
    """
    fields: dict[str, Any] = {
        "messages": [_message_fields(i, m) for i, m in enumerate(chat.messages)],
        "add_generation_prompt": chat.add_generation_prompt,
        "continue_final_message": chat.continue_final_message,
    }
    for name, text in (("tools", chat.tools_json), ("chat_template_kwargs", chat.chat_template_kwargs_json)):
        if text:
            fields[name] = _json_field(f"{name}_json", text)
    if chat.tools_json:
        fields["tool_choice"] = "none"  # this API never parses tool calls: tools are shown to the template
    return fields


def _message_fields(index: int, m: tokenizer_pb2.ChatMessage) -> dict[str, Any]:
    """One ``ChatMessage`` as /v1/chat/completions' JSON (its empty fields left out)."""
    fields: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        fields["name"] = m.name
    if m.tool_calls_json:
        fields["tool_calls"] = _json_field(f"messages[{index}].tool_calls_json", m.tool_calls_json)
    if m.tool_call_id:
        fields["tool_call_id"] = m.tool_call_id
    return fields


def _json_field(name: str, text: str) -> Any:
    """Raises ``GatewayError`` 400 when ``text`` is not JSON (or nests too deep to parse)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep to parse
        raise invalid_request(f"'{name}' is not valid JSON: {e}", param=name) from None


def tokenize_batch_request(
    prompts: list[Prompt], add_special_tokens: bool
) -> tokenizer_pb2.TokenizeBatchRequest:
    return tokenizer_pb2.TokenizeBatchRequest(
        requests=[tokenize_request(p, add_special_tokens) for p in prompts]
    )


def tokenized_prompt_from_pb(pb: tokenizer_pb2.TokenizeResponse) -> TokenizedPrompt:
    return TokenizedPrompt(input_ids=list(pb.input_ids), prompt_text=pb.prompt_text)


def tokenized_prompts_from_pb(pb: tokenizer_pb2.TokenizeBatchResponse) -> list[TokenizedPrompt]:
    return [tokenized_prompt_from_pb(r) for r in pb.responses]


def detokenize_request(ids: list[int], skip_special_tokens: bool) -> tokenizer_pb2.DetokenizeRequest:
    return tokenizer_pb2.DetokenizeRequest(input_ids=ids, skip_special_tokens=skip_special_tokens)


def token_pieces_request(ids: list[int]) -> tokenizer_pb2.TokenPiecesRequest:
    return tokenizer_pb2.TokenPiecesRequest(ids=ids)


def token_pieces_from_pb(pb: tokenizer_pb2.TokenPiecesResponse) -> list[TokenPiece]:
    return [TokenPiece(p.text, p.bytes) for p in pb.pieces]


def tokenizer_info_request() -> tokenizer_pb2.TokenizerInfoRequest:
    return tokenizer_pb2.TokenizerInfoRequest()


def model_info_from_pb(pb: tokenizer_pb2.TokenizerInfoResponse) -> ModelInfo:
    return ModelInfo(
        model_name=pb.model_name,
        vocab_size=pb.vocab_size,
        eos_token_ids=tuple(pb.eos_token_ids),
        context_length=pb.context_length,
        think_tokens=pb.think_tokens,
        tool_call_parser=pb.tool_call_parser,
        reasoning_parser=pb.reasoning_parser,
    )


def tokenized_req_to_pb(
    rid: str,
    input_ids: list[int],
    sampling_params: SamplingParams,
    *,
    prefill_address: str,
    fallback_prefill_addresses: list[str],
    output_address: str,
    gateway_address: str,
    deadline_unix_s: float,
    arrival_unix_s: float,
    resumed_output_ids: list[int] = (),
) -> scheduler_pb2.TokenizedGenerateReqInput:
    return scheduler_pb2.TokenizedGenerateReqInput(
        rid=rid,
        input_ids=input_ids,
        sampling_params=sampling_params_to_pb(sampling_params),
        prefill_address=prefill_address,
        fallback_prefill_addresses=fallback_prefill_addresses,
        output_address=output_address,
        gateway_address=gateway_address,
        deadline_unix_s=deadline_unix_s,
        arrival_unix_s=arrival_unix_s,
        resumed_output_ids=resumed_output_ids,
    )


def abort_request(rid: str, reason: str) -> scheduler_pb2.AbortRequest:
    return scheduler_pb2.AbortRequest(rid=rid, reason=reason)


def load_lora_adapter_request(name: str, path: str) -> scheduler_pb2.LoadLoraAdapterRequest:
    return scheduler_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)


def unload_lora_adapter_request(name: str) -> scheduler_pb2.UnloadLoraAdapterRequest:
    return scheduler_pb2.UnloadLoraAdapterRequest(lora_name=name)


def load_request() -> scheduler_pb2.LoadRequest:
    return scheduler_pb2.LoadRequest()


def worker_load_from_pb(info: common_pb2.LoadInfo) -> WorkerLoad:
    """A scheduler's ``LoadInfo`` as the router and admission control use it."""
    bounded = info.max_queued_requests > 0
    return WorkerLoad(
        load=info.num_running_reqs + info.num_queue_reqs,
        capacity=info.request_capacity + info.max_queued_requests if bounded else 0,
        incarnation=info.incarnation,
        max_queued=info.max_queued_requests,
        lora_resident=frozenset(info.lora_resident),
    )


def kv_events_request(from_seq: int | None, incarnation: str) -> scheduler_pb2.KVEventsRequest:
    """Subscribe from batch ``from_seq`` of ``incarnation`` (replay), or from a snapshot (None)."""
    return scheduler_pb2.KVEventsRequest(from_seq=from_seq, incarnation=incarnation)


def kv_event_batch_from_pb(pb: scheduler_pb2.KVEventBatch) -> tuple[str, KVEventBatch]:
    """``(incarnation, batch)`` of one ``KVEventBatch`` message (the inverse of the scheduler's
    ``kv_event_batch_to_pb``)."""
    events: list[KVEvent] = []
    for event in pb.events:
        kind = event.WhichOneof("event")
        if kind == "block_stored":
            e = event.block_stored
            parent = e.parent_block_hash if e.HasField("parent_block_hash") else None
            events.append(
                BlockStored(list(e.block_hashes), parent, list(e.token_ids), e.block_size, e.medium)
            )
        elif kind == "block_removed":
            events.append(BlockRemoved(list(event.block_removed.block_hashes), event.block_removed.medium))
        else:
            events.append(AllBlocksCleared())
    return pb.incarnation, KVEventBatch(pb.seq, pb.timestamp_unix_s, events, pb.snapshot)


def metrics_request() -> common_pb2.MetricsRequest:
    return common_pb2.MetricsRequest()


def metrics_from_pb(pb: common_pb2.MetricsResponse, role: str, address: str) -> tuple[str, str, str]:
    """``(role, worker, prometheus text)`` of a ``GetMetrics`` answer; ``role`` and ``address`` stand
    in for what it leaves empty."""
    return pb.role or role, pb.worker or address, pb.text


def choice_delta_from_pb(out: output_pb2.StrOutput, index: int) -> ChoiceDelta:
    """A ``ChoiceDelta`` for choice ``index`` from one detokenizer ``StrOutput``."""
    if out.matched_stop:
        matched: str | int | None = out.matched_stop
    elif out.finish_reason == common_pb2.FINISH_REASON_STOP and out.matched_stop_token:
        matched = out.matched_stop_token
    else:
        matched = None
    return ChoiceDelta(
        index=index,
        text=out.text_delta,
        token_ids=list(out.token_ids),
        logprobs=[_token_logprob(lp) for lp in out.logprobs],
        prompt_logprobs=[_token_logprob(lp) for lp in out.prompt_logprobs],
        embedding=list(out.embedding),
        finish_reason=_FINISH_FROM_PB.get(out.finish_reason),
        matched_stop=matched,
        error=out.error,
        retryable=out.retryable,
        prompt_tokens=out.prompt_tokens,
        cached_tokens=out.cached_tokens,
        completion_tokens=out.completion_tokens,
        worker_lost=out.worker_lost,
    )


def _token_logprob(lp: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, [TopLogprob(t.token_id, t.logprob) for t in lp.top], lp.rank)


def _token_logprob_to_pb(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    top = [common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top]
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=top, rank=lp.rank)


def str_columns(batch: output_pb2.BatchStrOutput) -> Iterator[tuple[str, str, list[int], int]]:
    """The column rows of ``batch`` (outputs that carry text and ids only), each as
    ``(rid, text_delta, token_ids, completion_tokens)``."""
    if not batch.rids:
        return
    ids = list(batch.token_ids)
    start = 0
    rows = zip(batch.rids, batch.text_deltas, batch.num_token_ids, batch.completion_tokens, strict=True)
    for rid, text, n, completion in rows:
        yield rid, text, ids[start : start + n], completion
        start += n


def embed_fields(request: api_pb2.EmbedRequest) -> dict[str, Any]:
    """``request`` as the JSON fields of /v1/embeddings (``texts`` and ``input_ids`` as one ``input``
    list: texts first; a mix of both, or neither, the model refuses)."""
    fields: dict[str, Any] = {"model": request.model, "input": list(request.texts)}
    fields["input"] += [list(t.ids) for t in request.input_ids]
    if request.dimensions:
        fields["dimensions"] = request.dimensions
    return fields


def embed_response_to_pb(vectors: list[list[float]], prompt_tokens: int) -> api_pb2.EmbedResponse:
    """The public API's answer: each input's vector, in order, and the prompt tokens of all."""
    return api_pb2.EmbedResponse(
        data=[api_pb2.Embedding(index=i, values=v) for i, v in enumerate(vectors)],
        usage=api_pb2.Usage(prompt_tokens=prompt_tokens),
    )


def generate_response_to_pb(rid: str, delta: ChoiceDelta) -> api_pb2.GenerateResponse:
    """The public API's streamed piece for ``delta``; usage is set on a choice's last piece."""
    resp = api_pb2.GenerateResponse(
        rid=rid,
        index=delta.index,
        text=delta.text,
        token_ids=delta.token_ids,
        logprobs=[_token_logprob_to_pb(lp) for lp in delta.logprobs],
        prompt_logprobs=[_token_logprob_to_pb(lp) for lp in delta.prompt_logprobs],
    )
    if delta.finish_reason is not None:
        resp.finish_reason = _FINISH_TO_PB[delta.finish_reason]
        if isinstance(delta.matched_stop, int):
            resp.matched_stop_token = delta.matched_stop
        elif delta.matched_stop is not None:
            resp.matched_stop = delta.matched_stop
        resp.usage.CopyFrom(
            api_pb2.Usage(
                prompt_tokens=delta.prompt_tokens,
                completion_tokens=delta.completion_tokens,
                cached_tokens=delta.cached_tokens,
            )
        )
    return resp
